"""CPU memory placement for the engine: the KV cache on huge pages, and allocator tuning.

Both exist because the CPU engine is bound by memory access more than by arithmetic: decode
attention reads every sequence's blocks, which sit at random places in a cache of gigabytes.
The page-level work (madvise, alignment) lives in kv_connector/hugepages.py, shared with the
connectors' staging buffers.
"""

from __future__ import annotations

import math

import torch

from splitserve.kv_connector.hugepages import empty_on_huge_pages as _empty_bytes
from splitserve.kv_connector.hugepages import libc


def tune_cpu_allocator() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the kernel.

    Each step allocates the same few-MB tensors (gathered K/V, logits). Above glibc's mmap
    threshold every such allocation is a fresh mmap whose pages fault in one by one; that
    doubled the cost of the CPU attention gather. Raising the mmap and trim thresholds lets the
    allocator reuse the memory. No-op where glibc is absent.
    """
    c = libc()
    if c is None:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    c.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    c.mallopt(m_trim_threshold, 1 << 30)
    c.mallopt(m_top_pad, 64 << 20)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on 2 MiB transparent huge pages where the kernel allows it.

    With 4 KiB pages a KV cache of a few GiB spans ~10^6 pages, far beyond the TLB, so every
    block that decode attention touches starts with a page walk; measured on an AVX2 VM, the
    decode kernel took twice as long over a 2 GiB cache as over a 40 MiB one. Elsewhere (no
    glibc, THP off) this is an ordinary zeroed tensor.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return _empty_bytes(nbytes, torch.device("cpu")).view(dtype).view(shape)
