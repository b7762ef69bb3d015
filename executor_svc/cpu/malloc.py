"""Keep large CPU tensors on glibc's heap instead of fresh pages from the kernel.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB) with a fresh mmap
and unmaps it on free, and hands the heap's free top back to the kernel past its trim threshold:
either way the next tensor that size page-faults in anew, and a long W1 prefill spends much of its
time in the kernel's page-fault handler. Fixing the threshold at its 32 MiB ceiling and never trimming
keeps that memory in the process, as jemalloc and tcmalloc (which CPU inference guides preload for this
reason) do; the cost is an RSS that stays at its peak.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("nanoserve.executor")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling on 64-bit
NEVER_TRIM_BYTES = (1 << 31) - 1


def keep_heap_memory() -> bool:
    """Apply it to this process; False where the C library is not glibc (nothing changes then)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = all(mallopt(option, value) for option, value in
                  ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, NEVER_TRIM_BYTES)))
    if not applied:
        log.info("glibc refused the malloc thresholds; large tensors keep their own pages")
    return applied
