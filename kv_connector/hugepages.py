"""2 MiB transparent huge pages under CPU KV caches and transfer buffers.

Every byte a connector moves on CPU is copied by the kernel through the pages of the KV tensor:
UCX's CMA transport (`process_vm_readv`) pins and maps each page of both processes, TCP copies
into and out of socket buffers page by page. On 4 KiB pages that per-page work dominates: NIXL
read 64 MiB at 4.8 GB/s between two processes here, 7.8 GB/s once both KV tensors sat on huge
pages, and raw gloo went from 1.5–2.2 to 2.7–3.6 GB/s (scripts/bench_transfer.py, issue 5).

The engine allocates its CPU KV cache here (`empty_on_huge_pages`, via engine/cpu_memory.py);
`use_huge_pages` makes sure of it for any tensor a connector registers, collapsing pages that
were faulted in as 4 KiB ones (`MADV_COLLAPSE`, Linux ≥ 6.1, synchronous, content kept). It must
run before the memory is registered with a transport that pins pages (RDMA): collapsing moves
them. Best effort: where the kernel refuses, transfers run on whatever pages there are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc through ctypes (madvise, mallopt), or None where there is none."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def use_huge_pages(tensor: torch.Tensor) -> int:
    """Ask for huge pages under the 2 MiB-aligned interior of a contiguous CPU tensor and
    collapse the pages already there; returns the bytes now covered (0 when refused)."""
    c = libc()
    if c is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    for advice, name in ((_MADV_HUGEPAGE, "MADV_HUGEPAGE"), (_MADV_COLLAPSE, "MADV_COLLAPSE")):
        if c.madvise(first, last - first, advice) != 0:
            logger.debug(
                "madvise(%s) on the KV cache failed (errno %d): it stays on 4 KiB pages",
                name,
                ctypes.get_errno(),
            )
            return 0
    return last - first


def empty_on_huge_pages(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed [nbytes] uint8 buffer; on CPU cut at a 2 MiB boundary and on huge pages where
    the kernel allows (the engine's KV cache; a transfer's staging buffer, which then copies as
    fast as the KV cache)."""
    import torch

    if device.type != "cpu" or nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + nbytes]
    use_huge_pages(buf)
    buf.fill_(0)  # fault the pages in now rather than during the first step or transfer
    return buf
