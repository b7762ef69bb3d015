"""The CPU KV cache and the packed weights on 2 MiB pages where the kernel offers them.

A decode step reads each running sequence's KV blocks, scattered over the whole cache, from memory: on 4 KiB pages
every 16-token block of a layer spans three pages, and the page walks hold the loads up. It also streams every
packed weight once, and on 4 KiB pages the stream waits on a page walk every 4 KiB. Where transparent huge pages are
in ``madvise`` mode (the default of most distributions) an allocation gets them only when it asks, before its pages
are first touched; this module asks. Where the kernel has none, or gives none, the tensors are the same on small
pages.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

log = logging.getLogger("nanoserve.executor")

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14


def _madvise() -> ctypes._CFuncPtr | None:
    if sys.platform != "linux":
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _huge_region(size: int, what: str) -> torch.Tensor:
    """``size`` zeroed bytes starting on a 2 MiB boundary, their pages asked to be huge before they are zeroed (the
    first touch, when the kernel picks each page's size)."""
    buffer = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    region = buffer[start : start + size]
    madvise = _madvise()
    whole_pages = size // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is not None and whole_pages and madvise(region.data_ptr(), whole_pages, MADV_HUGEPAGE) != 0:
        log.debug("the kernel refused huge pages for %s (errno %d)", what, ctypes.get_errno())
    return region.zero_()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, on huge pages where the kernel gives them."""
    size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return _huge_region(size, "the KV cache").view(dtype).view(shape)


def slices_on_huge_pages(sizes: list[int], align: int = 64) -> list[torch.Tensor]:
    """Zeroed byte tensors of ``sizes``, each starting on an ``align``-byte boundary of one region on huge pages where
    the kernel gives them: a model's packed weights, one after another as a decode step reads them."""
    starts, total = [], 0
    for size in sizes:
        total = -(-total // align) * align
        starts.append(total)
        total += size
    region = _huge_region(max(total, 1), "the packed weights")
    return [region[start : start + size] for start, size in zip(starts, sizes, strict=True)]
