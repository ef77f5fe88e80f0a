"""Paged prefill attention over a variable-length batch of query chunks (flash-attention style).

    q             : [T, Hq, D]                  query tokens of all sequences, back to back
    k/v_cache     : [num_blocks, bs, Hkv, D]    per-layer strided views of the block-major cache
    block_tables  : [S, max_blocks] int32
    cu_query_lens : [S + 1] int32               sequence s owns q[cu[s]:cu[s+1]]
    seq_lens      : [S] int32                   tokens in the cache after this step, chunk included
    out           : [T, Hq, D]

Sequence s's q_len = cu[s+1] - cu[s] query tokens sit at positions ctx .. seq_len - 1, with
ctx = seq_len - q_len tokens already cached before them (a prefix-cache hit or earlier chunks of a
chunked prefill). Every key/value, the chunk's own included, is read from the paged cache, so one
kernel serves fresh prompts (ctx = 0), prefix hits and chunked prefill alike:

      keys:     0 ........................ ctx ................ seq_len-1
                |<-- cached prefix: all -->|<-- chunk: causal -->|
      query i (0 <= i < q_len) at position ctx + i sees keys 0 .. ctx + i

Grid (T // BLOCK_M + S, Hq): program (i, h) takes one BLOCK_M-row tile of one sequence's queries for
query head h. Tile i's sequence is found by binary search over cu_query_lens: sequence s's tiles start
at cu[s] // BLOCK_M + s, an index that needs no host sync and wastes at most one tile per sequence
(programs past a sequence's last tile return at once). The KV loop runs in two parts: tiles that
every query row of the tile may see, without masks, then the diagonal tiles with the causal mask.
Each K/V tile of BLOCK_N tokens is gathered row by row through the block table (a whole KV block per
tile when bs <= BLOCK_N); scores and P @ V are tl.dot with fp32 accumulation, softmax online in base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import (
    ATTENTION_DTYPES,
    check_paged_cache,
    dot_in_fp32,
    pow2_at_least,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_query_lens_ptr, tile_id, num_seqs, BLOCK_M: tl.constexpr):
    """The last sequence s whose first tile index cu[s] // BLOCK_M + s is <= tile_id."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_query_lens_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    tile,
    q_pos,
    seq_len,
    bt_row,
    k_cache_ptr,
    v_cache_ptr,
    kv_head_offset,
    stride_cache_b,
    stride_cache_t,
    offs_n,
    offs_d,
    d_mask,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One online-softmax step of a [BLOCK_M, D] query tile against keys tile*BLOCK_N + [0, BLOCK_N)."""
    k_pos = tile * BLOCK_N + offs_n  # [BLOCK_N]
    if CAUSAL_MASK:
        n_mask = k_pos < seq_len
        block_ids = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        block_ids = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    rows = block_ids * stride_cache_b + (k_pos % BLOCK_SIZE) * stride_cache_t + kv_head_offset
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL_MASK:
        visible = (k_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    # m_new is finite: tile 0 comes first and every query row sees key 0.
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_cache_b,
    stride_cache_t,
    stride_cache_h,
    stride_bt_s,
    stride_out_t,
    stride_out_h,
    num_seqs,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_seq(cu_query_lens_ptr, tile_id, num_seqs, BLOCK_M)
    q_begin = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_begin
    q_start = (tile_id - (q_begin // BLOCK_M + seq)) * BLOCK_M  # first chunk row of this tile
    if q_start >= q_len:
        return

    # Never read past a block-table row, whatever seq_lens says.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    ctx_len = seq_len - q_len
    offs_m = q_start + tl.arange(0, BLOCK_M)  # chunk rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + offs_m

    tokens = (q_begin + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    kv_head_offset = (head // GROUP) * stride_cache_h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys 0 .. ctx + q_start are visible to every row of the tile: whole tiles of them need no mask.
    num_full_tiles = (ctx_len + q_start + 1) // BLOCK_N
    kv_end = ctx_len + tl.minimum(q_start + BLOCK_M, q_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    for tile in range(0, num_full_tiles):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, q_pos, seq_len, bt_row, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_cache_b, stride_cache_t, offs_n, offs_d, d_mask, scale_log2,
            BLOCK_SIZE, BLOCK_N, False, DOT_FP32,
        )  # fmt: skip
    for tile in range(num_full_tiles, num_tiles):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, q_pos, seq_len, bt_row, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_cache_b, stride_cache_t, offs_n, offs_d, d_mask, scale_log2,
            BLOCK_SIZE, BLOCK_N, True, DOT_FP32,
        )  # fmt: skip

    out_tile = acc / l_i[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_out_t + head * stride_out_h + offs_d[None, :]
    tl.store(
        out_ptrs, out_tile.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def _launch_config(head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): FA2-style tiles that fit Hopper's shared memory.

    Checked for sm_90 by tests/kernels/test_compile_sm90.py: 16-bit configs use wgmma with cp.async
    pipelining, 49-98 KiB of shared memory and no register spills. fp32 (tests, fp32 models) runs on
    FMA with IEEE precision and is kept small.
    """
    if dtype == torch.float32:
        return 64, 32, 8, 1
    if head_dim_pad > 128:
        return 64, 32, 8, 2
    if head_dim_pad == 128:
        return 128, 64, 8, 2
    return 128, 64, 4, 3


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query chunk over its sequence's paged K/V; returns [T, Hq, D].

    The chunk's own K/V must already be in the cache (reshape_and_cache first). `out` may be passed
    to write in place ([T, Hq, D], q's dtype, head_dim contiguous).
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_tokens, num_q_heads, _ = q.shape
    num_seqs = seq_lens.shape[0]
    assert q.shape == (num_tokens, num_q_heads, head_dim), f"q {q.shape} vs head_dim {head_dim}"
    assert q.stride(2) == 1, "head_dim of q must be contiguous"
    assert num_q_heads % num_kv_heads == 0, (
        f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    )
    assert q.dtype == k_cache.dtype and q.dtype in ATTENTION_DTYPES, (
        f"q {q.dtype}, cache {k_cache.dtype}"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert cu_query_lens.shape == (num_seqs + 1,) and cu_query_lens.dtype == torch.int32
    assert (
        seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and cu_query_lens.is_contiguous()
    )
    assert (
        q.device == k_cache.device == block_tables.device == cu_query_lens.device == seq_lens.device
    )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    head_dim_pad = pow2_at_least(head_dim, 16)
    block_m, block_n, num_warps, num_stages = _launch_config(head_dim_pad, q.dtype)
    grid = (num_tokens // block_m + num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_query_lens,
        seq_lens,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_seqs,
        block_tables.shape[1],
        BLOCK_SIZE=block_size,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
