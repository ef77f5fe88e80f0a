"""Paged decode attention: one query token per sequence over its block table, split-K when needed.

    q            : [S, Hq, D]                       the newest token of each sequence
    k/v_cache    : [num_blocks, bs, Hkv, D]         per-layer strided views of the block-major cache
    block_tables : [S, max_blocks] int32            block ids of each sequence, in token order
    seq_lens     : [S] int32                        tokens in the cache, the query token included
    out          : [S, Hq, D]

Grid (S, Hkv, num_splits). One program owns one sequence, one KV head and one slice of the context:

      context of sequence s:  |--- split 0 ---|--- split 1 ---| ... |- split n-1 -|
      tiles of TILE_N tokens:  [t0][t1][t2][t3][t4][t5][t6][t7] ...
                                 └ each token's block = block_table[pos // bs], row pos % bs

GQA: the Hq / Hkv query heads that share a KV head are the rows of one [GROUP_PAD, D] query tile, so
each K/V tile is read from memory once for all of them and scored with tl.dot (rows padded to 16, the
smallest dot shape; decode is bound by memory, not by the wasted rows). Softmax is online (flash
attention), in base 2 with the scale folded into log2(e), accumulated in fp32.

Split-K (flash-decoding): with few sequences, S * Hkv programs cannot fill the GPU, so the context is
cut into `num_splits` slices whose partial results (normalised output and log-sum-exp) go to fp32
scratch; a second small kernel merges them. With one split the first kernel writes `out` directly.
The split count depends only on shapes (batch, heads, block-table width), never on seq_lens values, so
it needs no device sync and is stable under CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import (
    ATTENTION_DTYPES,
    check_paged_cache,
    dot_in_fp32,
    num_sms,
    pow2_at_least,
)

_LOG2E = 1.4426950408889634
_MIN_TILES_PER_SPLIT = 4  # a split reads at least this many tiles (256 tokens at TILE_N = 64)
_MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [S, Hq, num_splits, HEAD_DIM_PAD] fp32, when SPLIT
    part_lse_ptr,  # [S, Hq, num_splits] fp32 (base 2), when SPLIT
    scale_log2,
    stride_q_s,
    stride_q_h,
    stride_cache_b,
    stride_cache_t,
    stride_cache_h,
    stride_bt_s,
    stride_out_s,
    stride_out_h,
    max_blocks,
    num_q_heads,
    num_splits,
    tiles_per_split,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Never read past a block-table row, whatever seq_lens says.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(seq_len, TILE_N))

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_s + q_heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(tile_begin, tile_end):
        pos = tile * TILE_N + offs_n  # [TILE_N] token positions
        n_mask = pos < seq_len
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block_ids * stride_cache_b + (pos % BLOCK_SIZE) * stride_cache_t
        rows += kv_head * stride_cache_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [GROUP_PAD, TILE_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile has a valid token
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has_tokens = l_i > 0.0  # False for an empty split and for padding rows (seq_len == 0)
    out_tile = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    if SPLIT:
        part = (seq * num_q_heads + q_heads).to(tl.int64) * num_splits + split  # [GROUP_PAD]
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        part_ptrs = part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(part_ptrs, out_tile, mask=g_mask[:, None])
    else:
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_out_s + q_heads[:, None] * stride_out_h
        out_ptrs += offs_d[None, :]
        tl.store(
            out_ptrs,
            out_tile.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_s,
    stride_out_h,
    num_q_heads,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Merge the splits of one (sequence, query head): out = sum_i w_i o_i / sum_i w_i, w_i = 2^lse_i."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits

    part = (seq * num_q_heads + head).to(tl.int64) * num_splits + offs_s  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # padding row: every weight is 0
    weights = tl.exp2(lse - lse_max)  # 0 for empty splits
    o_ptrs = part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    o = tl.load(o_ptrs, mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(weights, axis=0)
    merged = tl.sum(o * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)

    out_ptrs = out_ptr + seq.to(tl.int64) * stride_out_s + head * stride_out_h + offs_d
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _launch_config(head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int]:
    """(TILE_N, num_warps). 64 tokens keep a 16 KiB [64, 128] 16-bit K and V tile in flight per stage;
    fp32 (tests, fp32 models) halves the tile and doubles the warps to stay clear of register spills."""
    if dtype == torch.float32:
        return (64 if head_dim_pad <= 64 else 32), 8
    return (64 if head_dim_pad <= 128 else 32), 4


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, tile_n: int, device: torch.device
) -> int:
    """Split the context only when S * Hkv programs leave SMs idle, and never below 4 tiles a split.

    Aims at two programs per SM; e.g. on an H200 (132 SMs) batch 64 x 8 KV heads gets 1 split, batch 1
    x 8 KV heads x 32k tokens gets 33.
    """
    programs = batch * num_kv_heads
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    max_tiles = triton.cdiv(max_context, tile_n)
    by_occupancy = triton.cdiv(target, programs)
    by_length = max(1, max_tiles // _MIN_TILES_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [S, Hq, D] (one token per sequence) over its paged K/V; returns [S, Hq, D].

    seq_lens[s] counts the query token, whose K/V is already in the cache; seq_lens[s] == 0 marks a
    padding row (output zeros). num_splits=None picks a split-K factor from the shapes; `out` may be
    passed to write in place ([S, Hq, D], q's dtype, head_dim contiguous).
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_seqs, num_q_heads, _ = q.shape
    assert q.shape == (num_seqs, num_q_heads, head_dim), f"q {q.shape} vs head_dim {head_dim}"
    assert q.stride(2) == 1, "head_dim of q must be contiguous"
    assert num_q_heads % num_kv_heads == 0, (
        f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    )
    assert q.dtype == k_cache.dtype and q.dtype in ATTENTION_DTYPES, (
        f"q {q.dtype}, cache {k_cache.dtype}"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert (
        seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    )
    assert q.device == k_cache.device == block_tables.device == seq_lens.device
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    head_dim_pad = pow2_at_least(head_dim, 16)
    tile_n, num_warps = _launch_config(head_dim_pad, q.dtype)
    max_context = block_tables.shape[1] * block_size
    max_tiles = max(1, triton.cdiv(max_context, tile_n))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, tile_n, q.device)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    tiles_per_split = triton.cdiv(max_tiles, num_splits)
    num_splits = triton.cdiv(
        max_tiles, tiles_per_split
    )  # drop splits that could never hold a token

    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused

    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        block_tables.shape[1],
        num_q_heads,
        num_splits,
        tiles_per_split,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=pow2_at_least(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_n,
        SPLIT=split,
        DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=num_warps,
        num_stages=2,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            num_splits,
            SPLITS_PAD=pow2_at_least(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim_pad * num_splits >= 2048 else 2,
        )
    return out
