"""paged_prefill_attention against ref_paged_prefill_attention (and decode, where they overlap)."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.kernels.reference import ref_paged_prefill_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (head_dim, block_size, num_q_heads, num_kv_heads, dtype): a covering list, not a product.
CASES = [
    (64, 16, 4, 4, F32),
    (64, 16, 8, 2, F16),
    (64, 32, 8, 1, BF16),
    (128, 16, 8, 1, F32),
    (128, 32, 8, 2, F16),
    (128, 16, 2, 2, BF16),
    (128, 32, 8, 1, BF16),
    (64, 32, 2, 2, F16),
]


def _case_id(case: tuple) -> str:
    d, bs, hq, hkv, dtype = case
    return f"d{d}-bs{bs}-q{hq}kv{hkv}-{str(dtype).removeprefix('torch.')}"


def _chunks(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix, query chunk) per sequence: every shape the engine schedules."""
    return [
        (0, 1),  # a one-token prompt: context length 1
        (0, 2 * block_size),  # a fresh prompt ending exactly on a block boundary
        (block_size, 19),  # a prefix-cache hit of one block, then a chunk crossing a boundary
        (150, 140),  # a later chunk of a long chunked prefill: several query and key tiles
    ]


def _run(device, gen, paged_kv, tolerances, *, head_dim, block_size, hq, hkv, dtype, chunks):
    from splitserve.kernels import paged_prefill_attention

    seq_lens = [ctx + q_len for ctx, q_len in chunks]
    kv = paged_kv(
        seq_lens,
        block_size=block_size,
        num_kv_heads=hkv,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        gen=gen,
    )
    q_lens = torch.tensor([q_len for _, q_len in chunks])
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(cu[-1]), hq, head_dim, generator=gen).to(dtype).to(device)
    cu = cu.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu, lens, scale, out=out
    )
    assert got is out
    want = ref_paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, lens, scale)
    assert torch.isfinite(got).all(), "some outputs were never written"
    torch.testing.assert_close(got, want, **tolerances[dtype])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_prefill_matches_reference(case, device, gen, paged_kv, tolerances):
    head_dim, block_size, hq, hkv, dtype = case
    _run(
        device,
        gen,
        paged_kv,
        tolerances,
        head_dim=head_dim,
        block_size=block_size,
        hq=hq,
        hkv=hkv,
        dtype=dtype,
        chunks=_chunks(block_size),
    )


def test_prefill_odd_shapes(device, gen, paged_kv, tolerances):
    """head_dim 80 (padded inside), 3 query heads per KV head, an empty chunk, a 1-token chunk late."""
    _run(
        device,
        gen,
        paged_kv,
        tolerances,
        head_dim=80,
        block_size=16,
        hq=6,
        hkv=2,
        dtype=F16,
        chunks=[(5, 0), (0, 70), (200, 1), (31, 33)],
    )


def test_prefill_of_one_token_equals_decode(device, gen, paged_kv):
    """With one query token per sequence, prefill and decode compute the same attention."""
    from splitserve.kernels import paged_decode_attention, paged_prefill_attention

    seq_lens = [1, 16, 100, 333]
    kv = paged_kv(
        seq_lens, block_size=16, num_kv_heads=2, head_dim=64, dtype=F32, device=device, gen=gen
    )
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, lens, 0.125)
    decode = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125, 3)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)
