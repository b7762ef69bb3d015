"""The CPU KV cache on 2 MiB pages where the kernel offers them.

A decode step reads each running sequence's KV blocks, scattered over the whole cache, from memory: on 4 KiB pages
every 16-token block of a layer spans three pages, and the page walks hold the loads up. Where transparent huge
pages are in ``madvise`` mode (the default of most distributions) an allocation gets them only when it asks, before
its pages are first touched; this module asks for the cache. Where the kernel has none, or gives none, the cache is
the same tensor on small pages.
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


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, starting on a 2 MiB boundary, its pages asked to be huge
    before they are zeroed (the first touch, when the kernel picks each page's size)."""
    size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    buffer = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    region = buffer[start : start + size]
    madvise = _madvise()
    whole_pages = size // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is not None and whole_pages and madvise(region.data_ptr(), whole_pages, MADV_HUGEPAGE) != 0:
        log.debug("the kernel refused huge pages for the KV cache (errno %d)", ctypes.get_errno())
    return region.zero_().view(dtype).view(shape)
