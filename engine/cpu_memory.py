"""CPU memory placement for the engine: the KV cache on huge pages, and allocator tuning.

Both exist because the CPU engine is bound by memory access more than by arithmetic: decode
attention reads every sequence's blocks, which sit at random places in a cache of gigabytes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math

import torch

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def tune_cpu_allocator() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the kernel.

    Each step allocates the same few-MB tensors (gathered K/V, logits). Above glibc's mmap
    threshold every such allocation is a fresh mmap whose pages fault in one by one; that
    doubled the cost of the CPU attention gather. Raising the mmap and trim thresholds lets the
    allocator reuse the memory. No-op where glibc is absent.
    """
    libc = _libc()
    if libc is None:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_top_pad, 64 << 20)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor on 2 MiB transparent huge pages where the kernel allows it.

    With 4 KiB pages a KV cache of a few GiB spans ~10^6 pages, far beyond the TLB, so every
    block that decode attention touches starts with a page walk; measured on an AVX2 VM, the
    decode kernel took twice as long over a 2 GiB cache as over a 40 MiB one. The buffer is
    over-allocated by one huge page and cut at a 2 MiB boundary, then `madvise(MADV_HUGEPAGE)`
    asks for huge pages (Linux THP in `madvise` or `always` mode); the pages are faulted in by
    the caller's first write. Elsewhere this is a plain `torch.empty`.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    libc = _libc()
    if libc is None or nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[start : start + nbytes]
    length = nbytes - nbytes % _HUGE_PAGE
    if libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KiB pages", ctypes.get_errno())
    return buf.view(dtype).view(shape)
