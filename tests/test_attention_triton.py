"""Our Triton kernels: interpreted on this CPU against the torch backend, and compiled for a Hopper GPU.

Whether triton interprets is fixed process-wide when it is first imported, so the interpreted cases
(``tests/triton_kernel_cases.py``) run in a child process with ``TRITON_INTERPRET=1``, and the
compile check runs here with the real compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from executor_svc.attention import triton_kernels as kernels

CASES = Path(__file__).with_name("triton_kernel_cases.py")


def test_kernels_match_torch_backend_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def compile_for_hopper(kernel: object, arg_types: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compile through ptxas for sm_90 with no GPU present; arguments not named in ``arg_types`` are i32."""
    signature = {name: "constexpr" if name in constexprs else arg_types.get(name, "i32") for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))


ATTENTION_POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "scale": "fp32"}
ATTENTION_POINTERS |= {"cu_seqlens_q_ptr": "*i32", "cu_seqlens_k_ptr": "*i32"}


@pytest.mark.parametrize("dtype,paged", [("fp32", False), ("bf16", True)])
def test_kernels_compile_for_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: str, paged: bool) -> None:
    """The interpreter runs kernels a GPU build may reject (shapes, types, layouts): compile them for real."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, stated to silence its warning
    precision = "ieee" if dtype == "fp32" else None
    tensors = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    compile_for_hopper(kernels._store_kv_kernel, tensors | {"slot_ptr": "*i64"}, {"BLOCK_H": 4, "BLOCK_D": 64})
    blocks = {"BLOCK_N": 32, "BLOCK_D": 64, "DOT_PRECISION": precision}
    compile_for_hopper(kernels._paged_decode_kernel, tensors | ATTENTION_POINTERS, blocks | {"BLOCK_G": 16})
    prefill_blocks = blocks | {"BLOCK_M": 32, "PAGED": paged}
    compile_for_hopper(kernels._paged_prefill_kernel, tensors | ATTENTION_POINTERS, prefill_blocks)
