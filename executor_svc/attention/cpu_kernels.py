"""Builds and loads the C kernels in ``csrc/`` with the system C compiler, once per machine.

The library is compiled for the CPU it runs on (``-march=native``) into ``$NANOSERVE_CACHE/kernels``,
named by a hash of the source, the flags and the CPU's feature flags, so a cache shared between
machines never hands one a library built for another. No compiler, or a failed build, means no
kernel: the caller falls back to plain torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (imported before any kernel library: see paged_decode_library)

from executor_svc.model_registry import cache_root

log = logging.getLogger("nanoserve.executor")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = [
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
    # Reordered float sums vectorise; never -ffast-math, whose startup code sets flush-to-zero process-wide.
    "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
]


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"{SOURCE.stem}-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Build beside the target and rename: processes starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(built, target)
    log.info("built the CPU attention kernel %s in %.1f s", target.name, time.perf_counter() - started)


@functools.cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (logged once) when it cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: the CPU attention kernel is unavailable, using torch attention")
        return None
    target = _library_path(compiler)
    try:
        if not target.is_file():
            _build(compiler, target)
        # torch is loaded already, so the library's libgomp.so.1 resolves to torch's: one OpenMP thread pool.
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("could not build the CPU attention kernel (%s): using torch attention", detail)
        return None
    library.paged_decode.restype = ctypes.c_int
    library.paged_decode.argtypes = [
        *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 7, ctypes.c_float, ctypes.c_int,
    ]
    return library
