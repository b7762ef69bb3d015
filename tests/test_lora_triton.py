"""The Triton LoRA kernels: interpreted on this CPU against the torch update, and compiled for a Hopper GPU (as
``tests/test_attention_triton.py`` does for the attention kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc.lora import triton_kernels as kernels
from tests.test_attention_triton import compile_for_hopper

CASES = Path(__file__).with_name("lora_triton_cases.py")


def test_kernels_match_torch_under_the_interpreter() -> None:
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                           cwd=CASES.parents[1], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: str) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    pointers = {"slots_ptr": "*i32", "t_ptr": "*fp32"}
    compile_for_hopper(kernels._shrink_kernel, pointers | {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}"},
                       {"BLOCK_K": 64, "BLOCK_W": 64})
    compile_for_hopper(kernels._expand_kernel, pointers | {"b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"},
                       {"BLOCK_W": 64, "BLOCK_N": 64})
