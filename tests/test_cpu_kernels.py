"""How the C kernel library (``executor_svc/cpu/kernels.py``) is built, cached and loaded."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from executor_svc.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels"
)


def test_builds_once_per_machine_and_reports_a_broken_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    build = cpu_kernels.kernel_library.__wrapped__
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        assert build() is not None
        assert build() is not None
    assert sum("built the CPU kernels" in r.message for r in caplog.records) == 1
    assert len(list((tmp_path / "kernels").glob("cpu_kernels-*.so"))) == 1

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanoserve.executor"):
        assert build() is None
    assert "could not build the CPU kernels" in caplog.text


def test_loading_the_kernel_leaves_subnormal_floats_alone() -> None:
    """A library built with -ffast-math would switch the whole process to flush-to-zero when it loads."""
    assert cpu_kernels.kernel_library() is not None
    assert sys.float_info.min / 4 > 0
    assert torch.tensor([1e-40]).mul(1.0).item() != 0


def test_extra_compiler_flags_make_another_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NANOSERVE_KERNEL_CFLAGS`` is part of the build's name, so the kernel choice cached for one build is
    never read for another; a flag the compiler rejects leaves torch."""
    build = cpu_kernels.kernel_library.__wrapped__
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    plain = cpu_kernels.library_id()
    monkeypatch.setenv("NANOSERVE_KERNEL_CFLAGS", "-O2")
    assert cpu_kernels.library_id() != plain
    assert build() is not None
    assert [p.stem for p in (tmp_path / "kernels").glob("cpu_kernels-*.so")] == [cpu_kernels.library_id()]
    monkeypatch.setenv("NANOSERVE_KERNEL_CFLAGS", "--no-such-flag")
    assert build() is None
