"""Plain PyTorch references of every kernel in this package, written for clarity, not speed.

Each function has the signature of its Triton twin, prefixed `ref_`. The tests check the Triton kernels
against these; they also run anywhere PyTorch runs (CPU included), one sequence at a time.

The paged KV cache, as everywhere in splitserve:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (one tensor per instance)
    k_cache = kv_cache[:, layer, 0]     # [num_blocks, block_size, num_kv_heads, head_dim], strided
    v_cache = kv_cache[:, layer, 1]

Token `i` of a sequence lives in block `block_table[i // block_size]` at offset `i % block_size`; its
slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch

__all__ = [
    "ref_copy_blocks",
    "ref_pack_blocks",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_reshape_and_cache",
    "ref_unpack_blocks",
]


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[t] / value[t] ([num_kv_heads, head_dim]) at slot_mapping[t]; slot -1 means skip."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        k_cache[block_id, offset] = key[t]
        v_cache[block_id, offset] = value[t]


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence, in order: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[
        block_table[:num_blocks].long()
    ]  # [num_blocks, block_size, num_kv_heads, head_dim]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] at q_positions over k, v [Lk, Hkv, D] at 0..Lk-1 (>= fp32)."""
    group = q.shape[1] // k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    k = k.to(dtype).repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale  # [Hq, Lq, Lk]
    k_positions = torch.arange(k.shape[0], device=q.device)
    visible = k_positions[None, :] <= q_positions[:, None]  # [Lq, Lk]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Lq, Hq, D]


def ref_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (the last of its seq_lens[s] tokens) over its paged KV.

    A sequence with seq_lens[s] == 0 is a padding row: its output is zeros. num_splits is accepted for
    signature parity and ignored.
    """
    del num_splits
    if out is None:
        out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[s] = 0
            continue
        k = _gather_kv(k_cache, block_tables[s], seq_len)
        v = _gather_kv(v_cache, block_tables[s], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[s] = _attention(q[s : s + 1], k, v, q_pos, scale)[0].to(out.dtype)
    return out


def ref_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query chunks q[cu[s]:cu[s+1]] at the last positions of each sequence, causal over its KV."""
    if out is None:
        out = torch.empty_like(q)
    cu = cu_query_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_s = q[cu[s] : cu[s + 1]]  # [q_len, Hq, D]
        q_len = q_s.shape[0]
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[s], seq_len)
        v = _gather_kv(v_cache, block_tables[s], seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        out[cu[s] : cu[s + 1]] = _attention(q_s, k, v, q_pos, scale).to(out.dtype)
    return out


def ref_pack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy whole blocks kv_cache[block_ids[i]] into row i of a contiguous [n, block_numel] buffer."""
    staging = kv_cache[block_ids.long()].reshape(block_ids.numel(), -1)
    if out is None:
        return staging.contiguous()
    out.copy_(staging)
    return out


def ref_unpack_blocks(
    staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Copy row i of staging [n, block_numel] into block kv_cache[block_ids[i]]."""
    for i, block_id in enumerate(block_ids.tolist()):
        kv_cache[block_id] = staging[i].view(kv_cache.shape[1:])


def ref_copy_blocks(
    kv_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    """Copy block src_block_ids[i] onto block dst_block_ids[i] (all layers, K and V)."""
    for src, dst in zip(src_block_ids.tolist(), dst_block_ids.tolist(), strict=True):
        kv_cache[dst] = kv_cache[src]
