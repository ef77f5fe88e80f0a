"""pack_blocks / unpack_blocks / copy_blocks against their references: bit-exact."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.reference import ref_copy_blocks, ref_pack_blocks, ref_unpack_blocks

# (num_layers, block_size, num_kv_heads, head_dim, dtype): block_numel from 2 Ki to 64 Ki elements,
# both below and above one 16 KiB chunk, and a 1-byte dtype.
CASES = [
    (1, 16, 1, 64, torch.float32),
    (2, 16, 2, 128, torch.float16),
    (4, 32, 2, 64, torch.bfloat16),
    (3, 16, 1, 80, torch.float32),
    (2, 32, 2, 128, torch.float8_e4m3fn),
]


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-exact equality, NaNs included (compared as integers of the same width)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    assert torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def _cache(
    shape: tuple, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]}-bs{c[1]}-kv{c[2]}-d{c[3]}-{c[4]}")
def test_pack_unpack_copy(case, device, gen):
    from splitserve.kernels import copy_blocks, pack_blocks, unpack_blocks

    num_layers, block_size, hkv, head_dim, dtype = case
    num_blocks = 10
    kv_cache = _cache((num_blocks, num_layers, 2, block_size, hkv, head_dim), dtype, device, gen)
    block_numel = kv_cache[0].numel()

    # pack into a poisoned staging buffer, ids out of order and with a repeat
    ids = torch.tensor([7, 2, 9, 0, 2], device=device)
    staging = torch.full((5, block_numel), float("nan")).to(dtype).to(device)
    got = pack_blocks(kv_cache, ids, out=staging)
    assert got is staging
    _exact(staging, ref_pack_blocks(kv_cache, ids))
    _exact(pack_blocks(kv_cache, ids), staging)  # allocating form

    # unpack fresh rows into other blocks; the rest of the cache must not move
    rows = _cache((3, block_numel), dtype, device, gen)
    dst = torch.tensor([4, 1, 8], device=device)
    got_cache, want_cache = kv_cache.clone(), kv_cache.clone()
    unpack_blocks(rows, got_cache, dst)
    ref_unpack_blocks(rows, want_cache, dst)
    _exact(got_cache, want_cache)

    # block to block (destinations disjoint from sources)
    src, dst = torch.tensor([0, 3, 3], device=device), torch.tensor([5, 6, 9], device=device)
    copy_blocks(got_cache, src, dst)
    ref_copy_blocks(want_cache, src, dst)
    _exact(got_cache, want_cache)


def test_empty_and_bad_inputs(device, gen):
    from splitserve.kernels import copy_blocks, pack_blocks, unpack_blocks

    kv_cache = _cache((4, 1, 2, 16, 1, 64), torch.float16, device, gen)
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert pack_blocks(kv_cache, none).shape == (0, kv_cache[0].numel())
    unpack_blocks(
        torch.empty(0, kv_cache[0].numel(), dtype=torch.float16, device=device), kv_cache, none
    )
    copy_blocks(kv_cache, none, none)
    with pytest.raises(AssertionError):  # int32 ids
        pack_blocks(kv_cache, torch.tensor([1], dtype=torch.int32, device=device))
    with pytest.raises(AssertionError):  # a per-layer view is not the whole cache
        pack_blocks(kv_cache[:, 0], torch.tensor([1], device=device))
    with pytest.raises(AssertionError):  # staging of the wrong dtype
        unpack_blocks(
            torch.zeros(1, kv_cache[0].numel(), device=device),
            kv_cache,
            torch.tensor([1], device=device),
        )
