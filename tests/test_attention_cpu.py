"""The ``cpu`` backend's C decode kernel against dense attention and the torch backend."""

from __future__ import annotations

import ctypes

import pytest
import torch

import executor_svc.attention as attention
from executor_svc.attention import available_backends, get_backend
from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu import kernels as cpu_kernels
from tests.attention_helpers import cpu_kernel_builds
from tests.test_attention_torch import BLOCK_SIZES, HEADS, PagedBatch, run_decode

CPU = torch.device("cpu")
BUILDS = cpu_kernel_builds()

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU attention kernel"
)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("build", BUILDS)
def test_decode_matches_dense_attention(num_heads: int, num_kv_heads: int, block_size: int, build: ctypes.CDLL) -> None:
    """Lengths off and on block boundaries, a 1-token context, and one long enough to run past the prefetch."""
    ctx_lens = [1, 17, 40, block_size, 3, 301]
    batch = PagedBatch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads)
    out = run_decode(batch, 0.3, CpuAttention(build))
    torch.testing.assert_close(out, batch.expected(0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (8, 8, 32), (4, 1, 5), (16, 2, 16)])
@pytest.mark.parametrize("build", BUILDS)
def test_tiled_decode_matches_dense_attention(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                                              build: ctypes.CDLL):
    """The tiled paths' head sizes: partial tiles (8 tokens with AVX2, 16 with AVX-512), one token, an empty
    tail, a long context, groups of 8 query heads (two passes over a tile's values with AVX2), and scores large
    enough (scale 2) that the online softmax's running maximum moves from tile to tile."""
    ctx_lens = [1, 7, 8, 9, 15, 16, 17, 33, 1000]
    batch = PagedBatch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads, head_dim)
    for scale in (head_dim**-0.5, 2.0):
        out = run_decode(batch, scale, CpuAttention(build))
        torch.testing.assert_close(out, batch.expected(scale), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("build", BUILDS)
def test_bfloat16_tiled_decode_matches_the_torch_backend(build: ctypes.CDLL) -> None:
    batch = PagedBatch([1, 7, 9, 16, 17, 250, 700], [1] * 7, 16, 9, 3, 64)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    batch.q = [q.bfloat16() for q in batch.q]
    batch.k, batch.v = [k.bfloat16() for k in batch.k], [v.bfloat16() for v in batch.v]
    out, reference = run_decode(batch, 0.125, CpuAttention(build)), run_decode(batch, 0.125, TorchAttention())
    exact = batch.expected(0.125)
    assert (out.float() - exact).abs().max() <= (reference.float() - exact).abs().max() + 1e-2


@pytest.mark.parametrize("build", BUILDS)
def test_bfloat16_decode_matches_the_torch_backend(build: ctypes.CDLL) -> None:
    """bfloat16 q and cache in, bfloat16 out, rounded from float32 sums: as close to torch as torch is to float64."""
    batch = PagedBatch([5, 64, 129, 250], [1] * 4, 16, 9, 3)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    batch.q = [q.bfloat16() for q in batch.q]
    batch.k, batch.v = [k.bfloat16() for k in batch.k], [v.bfloat16() for v in batch.v]
    out, reference = run_decode(batch, 0.125, CpuAttention(build)), run_decode(batch, 0.125, TorchAttention())
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
