"""reshape_and_cache against ref_reshape_and_cache: bit-exact, and nothing else in the cache moves."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.reference import ref_reshape_and_cache

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (head_dim, block_size, num_kv_heads, dtype)
CASES = [
    (64, 16, 1, F32),
    (64, 32, 8, F16),
    (128, 16, 2, BF16),
    (128, 32, 4, F32),
    (80, 16, 3, F16),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"d{c[0]}-bs{c[1]}-kv{c[2]}-{str(c[3]).removeprefix('torch.')}" for c in CASES],
)
def test_reshape_and_cache_matches_reference(case, device, gen):
    from splitserve.kernels import reshape_and_cache

    head_dim, block_size, hkv, dtype = case
    num_blocks, num_layers, num_tokens, hq = 12, 2, 45, 4
    # Poisoned cache: every slot that is not written must stay NaN.
    shape = (num_blocks, num_layers, 2, block_size, hkv, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    want = kv_cache.clone()

    # key/value as strided slices of a fused QKV projection output: [T, Hq + 2 Hkv, D].
    qkv = torch.randn(num_tokens, hq + 2 * hkv, head_dim, generator=gen).to(dtype).to(device)
    key, value = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7, 44]] = -1  # padding tokens: skipped
    slots[1] = block_size  # exactly on a block boundary
    slots[2] = num_blocks * block_size - 1  # the cache's last slot
    slots = slots.to(device)

    layer = 1
    reshape_and_cache(key, value, kv_cache[:, layer, 0], kv_cache[:, layer, 1], slots)
    ref_reshape_and_cache(key, value, want[:, layer, 0], want[:, layer, 1], slots)
    torch.testing.assert_close(kv_cache, want, atol=0, rtol=0, equal_nan=True)
    assert kv_cache[:, 0].isnan().all(), "another layer was written"
    assert (~kv_cache.isnan()).sum() == 2 * (num_tokens - 3) * hkv * head_dim


def test_reshape_and_cache_empty_batch(device):
    from splitserve.kernels import reshape_and_cache

    kv_cache = torch.zeros(2, 1, 2, 16, 2, 64, device=device)
    empty = torch.empty(0, 2, 64, device=device)
    reshape_and_cache(
        empty,
        empty,
        kv_cache[:, 0, 0],
        kv_cache[:, 0, 1],
        torch.empty(0, dtype=torch.int64, device=device),
    )
