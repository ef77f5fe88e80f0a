"""Host-side helpers shared by the kernel wrappers: the paged-cache layout checks and launch facts.

No Triton here, so this module imports anywhere.
"""

from __future__ import annotations

import functools
import os

import torch

# dtypes the attention kernels accept for q and the KV cache (they accumulate in fp32).
ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1, read at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast tl.dot operands to fp32.

    The Triton interpreter multiplies bf16 operands of tl.dot as raw bits (garbage), so under it bf16 is
    upcast; fp32 and fp16 are exact there. On a GPU the tensor cores take 16-bit operands directly.
    """
    return dtype == torch.bfloat16 and interpreter_active()


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); tl.arange and tl.dot need such extents."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; an H200's 132 off CUDA (the interpreter), for heuristics."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Assert the per-layer paged-cache layout; return (block_size, num_kv_heads, head_dim).

    k_cache = kv_cache[:, layer, 0] of kv_cache [num_blocks, num_layers, 2, block_size, Hkv, D]:
    within a block the layer's K rows are dense ([block_size, Hkv, D] row-major), while stride(0) jumps
    over a whole block of every layer (any value). v_cache is the same view at index 1.
    """
    assert k_cache.dim() == 4, (
        f"k_cache must be [num_blocks, block_size, Hkv, D], got {k_cache.shape}"
    )
    assert v_cache.shape == k_cache.shape, f"v_cache {v_cache.shape} != k_cache {k_cache.shape}"
    assert v_cache.stride() == k_cache.stride(), (
        "k_cache and v_cache must be views with equal strides"
    )
    assert v_cache.dtype == k_cache.dtype and v_cache.device == k_cache.device
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert k_cache.stride(2) == head_dim, "heads of one token must be adjacent"
    assert k_cache.stride(1) == num_kv_heads * head_dim, "tokens of one block must be adjacent"
    return block_size, num_kv_heads, head_dim
