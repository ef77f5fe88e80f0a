"""Kernel tests: natively on CUDA when a GPU is present, else on Triton's CPU interpreter.

TRITON_INTERPRET must be set before the first `import triton`. pytest imports this conftest before the
test modules of this folder, and those modules import triton (through splitserve.kernels' lazy names)
only inside test functions. The interpreter costs milliseconds per program per loop iteration, so the
cases are small and parametrized as a covering list, not a cartesian product.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

# Per dtype: inputs are N(0, 1) and outputs are softmax averages of them, so atol ~ rtol.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture(scope="session")
def tolerances() -> dict[torch.dtype, dict[str, float]]:
    """assert_close tolerances by dtype."""
    return TOLERANCES


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else CPU under the interpreter; skips the test when triton is missing."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    assert os.environ.get("TRITON_INTERPRET") == "1", "no GPU: tests need TRITON_INTERPRET=1"
    return torch.device("cpu")


@pytest.fixture
def gen() -> torch.Generator:
    """A fixed-seed CPU generator: inputs are drawn on the CPU, then moved to the device."""
    return torch.Generator().manual_seed(1234)


@dataclass
class PagedKV:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, Hkv, D]
    k_cache: torch.Tensor  # kv_cache[:, layer, 0]
    v_cache: torch.Tensor  # kv_cache[:, layer, 1]
    block_tables: torch.Tensor  # [S, max_blocks] int32


def make_paged_kv(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    num_layers: int = 2,
    layer: int = 1,
    extra_columns: int = 2,
) -> PagedKV:
    """A random block-major cache and block tables giving each sequence its own shuffled blocks.

    Table columns past a sequence's last block hold random *valid* block ids, so a kernel that reads
    past seq_len gets wrong numbers (a failing test) rather than a wild pointer.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq, default=0) + extra_columns
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[used : used + n]
        used += n
    kv_cache = kv_cache.to(device)
    return PagedKV(
        kv_cache=kv_cache,
        k_cache=kv_cache[:, layer, 0],
        v_cache=kv_cache[:, layer, 1],
        block_tables=block_tables.to(torch.int32).to(device),
    )


@pytest.fixture
def paged_kv():
    """The factory `make_paged_kv(seq_lens, block_size=…, num_kv_heads=…, head_dim=…, …)`."""
    return make_paged_kv
