"""The ``cpu`` backend's C decode kernel against dense attention and the torch backend, and how it is built."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

import executor_svc.attention as attention
from executor_svc.attention import available_backends, cpu_kernels, get_backend
from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.attention.torch_backend import TorchAttention
from tests.test_attention_torch import BLOCK_SIZES, HEADS, PagedBatch, run_decode

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU attention kernel"
)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_dense_attention(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """Lengths off and on block boundaries, a 1-token context, and one long enough to run past the prefetch."""
    ctx_lens = [1, 17, 40, block_size, 3, 301]
    batch = PagedBatch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads)
    out = run_decode(batch, 0.3, CpuAttention())
    torch.testing.assert_close(out, batch.expected(0.3), atol=1e-5, rtol=1e-5)


def test_bfloat16_decode_matches_the_torch_backend() -> None:
    """bfloat16 q and cache in, bfloat16 out, rounded from float32 sums: as close to torch as torch is to float64."""
    batch = PagedBatch([5, 64, 129, 250], [1] * 4, 16, 9, 3)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    batch.q = [q.bfloat16() for q in batch.q]
    batch.k, batch.v = [k.bfloat16() for k in batch.k], [v.bfloat16() for v in batch.v]
    out, reference = run_decode(batch, 0.125, CpuAttention()), run_decode(batch, 0.125, TorchAttention())
    assert out.dtype == torch.bfloat16
    exact = batch.expected(0.125)
    assert (out.float() - exact).abs().max() <= (reference.float() - exact).abs().max() + 1e-2


def test_unsupported_dtypes_and_layouts_fall_back_to_torch() -> None:
    """float16, and a float32 query over a bfloat16 cache, go to the torch backend's decode."""
    batch = PagedBatch([7, 20], [1, 1], 4, 4, 2)
    batch.k_cache, batch.v_cache = batch.k_cache.half(), batch.v_cache.half()
    batch.q = [q.half() for q in batch.q]
    batch.k, batch.v = [k.half() for k in batch.k], [v.half() for v in batch.v]
    assert torch.equal(run_decode(batch, 0.25, CpuAttention()), run_decode(batch, 0.25, TorchAttention()))
    mixed = PagedBatch([7, 20], [1, 1], 4, 4, 2)
    mixed.k_cache, mixed.v_cache = mixed.k_cache.bfloat16(), mixed.v_cache.bfloat16()
    assert torch.equal(run_decode(mixed, 0.25, CpuAttention()), run_decode(mixed, 0.25, TorchAttention()))


def test_cpu_prefers_the_kernel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert available_backends(CPU) == ["cpu", "torch"]
    assert isinstance(get_backend(None, CPU), CpuAttention)
    assert isinstance(get_backend("torch", CPU), TorchAttention)


def test_without_the_kernel_cpu_serves_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cpu_kernels, "kernel_library", lambda: None)
    assert available_backends(CPU) == ["torch"]
    assert get_backend(None, CPU).name == "torch"
    with pytest.raises(ValueError, match=r"'cpu'.*\['torch'\]"):
        attention.get_backend("cpu", CPU)


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
