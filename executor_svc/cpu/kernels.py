"""Builds and loads the C kernels in ``csrc/`` with the system C compiler, once per machine.

All sources make one library, compiled for the CPU it runs on (``-march=native``) into ``$NANOSERVE_CACHE/kernels``,
named by a hash of the sources and headers, the flags and the CPU's feature flags, so a cache shared between
machines never hands one a library built for another. ``$NANOSERVE_KERNEL_CFLAGS`` adds flags after the defaults,
such as ``-mno-avx512f`` to run the AVX2 kernels on an AVX-512 machine (``bench.kernels`` then times them there).
No compiler, or a failed build, means no kernel: the caller falls back to plain torch.
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

import torch  # imported before any kernel library: see kernel_library

from executor_svc.cpu.cpuinfo import cpu_flags, cpuinfo
from executor_svc.runtime.registry import cache_root

log = logging.getLogger("nanoserve.executor")

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.c"))
HEADERS = sorted(CSRC.glob("*.h"))
FLAGS = [
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
    # Reordered float sums vectorise; never -ffast-math, whose startup code sets flush-to-zero process-wide.
    "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
    # a * b + c stays two roundings, as in torch (fused_ops.c matches its elementwise ops); intrinsics still FMA.
    "-ffp-contract=off",
]


def contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a contiguous tensor of ``dtype`` for a kernel to read: itself where it is one already (a no-op
    ``.to`` still costs a dispatch, and each of a step's layers asks)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def names_bfloat16_instructions() -> bool:
    """Whether /proc/cpuinfo names an x86 bfloat16 multiply (AVX512_BF16 or AMX_BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _library_path(compiler: str, flags: list[str]) -> Path:
    key = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES + HEADERS]
    for part in (*sources, " ".join(flags).encode(), compiler.encode(), platform.machine().encode(),
                 cpuinfo("flags", "Features").encode()):
        key.update(part)
    return cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Build beside the target and rename: processes starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(built, target)
    log.info("built the CPU kernels %s in %.1f s", target.name, time.perf_counter() - started)


def _flags(extra_flags: tuple[str, ...] = ()) -> list[str]:
    return [*FLAGS, *os.environ.get("NANOSERVE_KERNEL_CFLAGS", "").split(), *extra_flags]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_id() -> str:
    """The name of this machine's kernel build (a hash of sources, flags and CPU features), or ``none``."""
    compiler = _compiler()
    return "none" if compiler is None else _library_path(compiler, _flags()).stem


@functools.cache
def kernel_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The loaded kernel library, or None (logged once) when it cannot be built here. ``extra_flags`` build a
    variant beside it: ``("-mno-avx512f",)`` gives an AVX-512 machine the AVX2 kernels, for their tests."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler found: the CPU kernels are unavailable, using torch")
        return None
    flags = _flags(extra_flags)
    target = _library_path(compiler, flags)
    try:
        if not target.is_file():
            _build(compiler, flags, target)
        # torch is loaded already, so the library's libgomp.so.1 resolves to torch's: one OpenMP thread pool.
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("could not build the CPU kernels (%s): using torch", detail)
        return None
    pointer, size, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    library.paged_decode.restype = i32
    library.paged_decode.argtypes = [*[pointer] * 6, *[i32] * 7, f32, i32]
    library.rms_norm.restype = None
    library.rms_norm.argtypes = [pointer, size, pointer, pointer, pointer, size, i32, f32, i32, i32]
    library.silu_and_mul.restype = None
    library.silu_and_mul.argtypes = [pointer, pointer, size, i32, i32, i32]
    library.rotary.restype = size
    library.rotary.argtypes = [
        pointer, size, pointer, size, pointer, pointer, pointer, size, size, i32, i32, i32, i32, i32,
    ]
    library.store_kv.restype = size
    library.store_kv.argtypes = [pointer, size, pointer, size, pointer, pointer, pointer, size, size, i32, i32]
    library.linear_is_vectorised.restype = i32
    library.linear_is_vectorised.argtypes = []
    library.linear_amx_ready.restype = i32
    library.linear_amx_ready.argtypes = []
    library.linear_packed_bytes.restype = size
    library.linear_packed_bytes.argtypes = [size, size, i32]
    library.linear_pack.restype = None
    library.linear_pack.argtypes = [pointer, pointer, size, size, i32]
    library.linear_forward.restype = i32
    library.linear_forward.argtypes = [pointer, size, pointer, pointer, pointer, size, size, size, i32, i32]
    library.prefill_attention_supported.restype = i32
    library.prefill_attention_supported.argtypes = [i32]
    library.prefill_attention.restype = i32
    library.prefill_attention.argtypes = [
        pointer, size, pointer, size, pointer, size, *[pointer] * 3, i32, pointer, pointer, i32, pointer,
        *[i32] * 5, f32, i32,
    ]
    library.argmax_rows.restype = None
    library.argmax_rows.argtypes = [pointer, size, size, size, pointer, i32, i32]
    library.decode_stack_scratch_bytes.restype = size
    library.decode_stack_scratch_bytes.argtypes = [pointer, size]
    library.decode_stack.restype = i32
    library.decode_stack.argtypes = [pointer, i32, pointer, pointer]
    library.decode_stack_attention.restype = i32
    library.decode_stack_attention.argtypes = [pointer] * 5
    library.spin_until.restype = None
    library.spin_until.argtypes = [ctypes.c_double]
    return library
