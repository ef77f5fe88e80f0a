"""paged_decode_attention against ref_paged_decode_attention."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.kernels.reference import ref_paged_decode_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (head_dim, block_size, num_q_heads, num_kv_heads, dtype, num_splits): a covering list, not a product.
# Every case runs sequences of 1 token, exactly one and two blocks, and a long one (several splits).
CASES = [
    (64, 16, 4, 4, F32, None),
    (64, 16, 8, 2, F16, 1),
    (64, 32, 8, 1, BF16, None),
    (128, 16, 8, 1, F32, 5),
    (128, 32, 8, 2, F16, None),
    (128, 16, 2, 2, BF16, 3),
    (128, 32, 8, 1, BF16, 1),
    (64, 32, 2, 2, F16, 7),
    (64, 16, 8, 2, BF16, 4),
    (128, 16, 8, 2, F32, 2),
]


def _case_id(case: tuple) -> str:
    d, bs, hq, hkv, dtype, splits = case
    return f"d{d}-bs{bs}-q{hq}kv{hkv}-{str(dtype).removeprefix('torch.')}-splits{splits}"


def _run(
    device,
    gen,
    paged_kv,
    tolerances,
    *,
    head_dim,
    block_size,
    hq,
    hkv,
    dtype,
    num_splits,
    seq_lens,
    q_gain=1.0,
):
    from splitserve.kernels import paged_decode_attention

    kv = paged_kv(
        seq_lens,
        block_size=block_size,
        num_kv_heads=hkv,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        gen=gen,
    )
    q = (q_gain * torch.randn(len(seq_lens), hq, head_dim, generator=gen)).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, lens, scale, num_splits=num_splits, out=out
    )
    assert got is out
    want = ref_paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, scale)
    assert torch.isfinite(got).all(), "some outputs were never written"
    torch.testing.assert_close(got, want, **tolerances[dtype])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_decode_matches_reference(case, device, gen, paged_kv, tolerances):
    head_dim, block_size, hq, hkv, dtype, num_splits = case
    seq_lens = [1, block_size, 2 * block_size, 40 * block_size - 5]
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
        num_splits=num_splits,
        seq_lens=seq_lens,
    )


def test_decode_large_logits_are_stable(device, gen, paged_kv, tolerances):
    """Scores in the hundreds: the online softmax must subtract running maxima, across splits too."""
    _run(
        device,
        gen,
        paged_kv,
        tolerances,
        head_dim=64,
        block_size=16,
        hq=8,
        hkv=2,
        dtype=F32,
        num_splits=3,
        seq_lens=[300, 17, 1],
        q_gain=30.0,
    )


def test_decode_odd_head_dim_and_group(device, gen, paged_kv, tolerances):
    """head_dim 80 (padded to 128 inside) and 3 query heads per KV head (padded to 16 rows)."""
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
        num_splits=None,
        seq_lens=[33, 1, 250],
    )


def test_decode_padding_rows_and_strided_q(device, gen, paged_kv, tolerances):
    """seq_lens == 0 marks a padding row (zeros); q may be a strided slice of a fused QKV tensor."""
    from splitserve.kernels import paged_decode_attention

    hq, hkv, d, bs = 8, 2, 64, 16
    seq_lens = [40, 0, 300, 0]
    kv = paged_kv(
        seq_lens, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=F16, device=device, gen=gen
    )
    qkv = torch.randn(len(seq_lens), hq + 2 * hkv, d, generator=gen).to(F16).to(device)
    q = qkv[:, :hq]  # [S, Hq, D], stride(0) = (Hq + 2 Hkv) * D
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    for num_splits in (1, 4):
        got = paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125, num_splits
        )
        want = ref_paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.125)
        torch.testing.assert_close(got, want, **tolerances[F16])
        assert (got[1] == 0).all() and (got[3] == 0).all()


def test_choose_num_splits():
    from splitserve.kernels.decode_attention import choose_num_splits

    cpu = torch.device("cpu")  # heuristics assume an H200's 132 SMs off CUDA
    assert choose_num_splits(64, 8, 4096, 64, cpu) == 1  # 512 programs fill the GPU
    assert choose_num_splits(1, 8, 32768, 64, cpu) == 33  # 2 programs per SM
    assert choose_num_splits(1, 8, 512, 64, cpu) == 2  # short: >= 4 tiles per split
    assert choose_num_splits(1, 1, 64, 64, cpu) == 1
    assert choose_num_splits(1, 1, 1 << 20, 64, cpu) == 64  # capped


def test_decode_rejects_bad_layout(device, gen, paged_kv):
    from splitserve.kernels import paged_decode_attention

    kv = paged_kv(
        [20], block_size=16, num_kv_heads=2, head_dim=64, dtype=F32, device=device, gen=gen
    )
    q = torch.randn(1, 4, 64, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    with pytest.raises(AssertionError):  # a transposed cache view
        paged_decode_attention(
            q, kv.k_cache.transpose(1, 2), kv.v_cache.transpose(1, 2), kv.block_tables, lens, 0.1
        )
    with pytest.raises(AssertionError):  # int64 block tables
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), lens, 0.1)
    with pytest.raises(AssertionError):  # dtype mismatch
        paged_decode_attention(q.half(), kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.1)
