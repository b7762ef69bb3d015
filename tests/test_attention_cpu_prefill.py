"""The C prefill attention kernel (``csrc/prefill_attention.c``) against float64 attention and the torch backend."""

from __future__ import annotations

import ctypes

import pytest
import torch

from executor_svc.attention.cpu_backend import CpuAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.choice import KernelChoice
from tests.attention_helpers import cpu_kernel_builds
from tests.test_attention_torch import PagedBatch

library = cpu_kernels.kernel_library()
pytestmark = pytest.mark.skipif(
    library is None or not library.prefill_attention_supported(64), reason="the prefill kernel needs AVX-512 or AVX2"
)
BUILDS = cpu_kernel_builds()

# Cached prefixes mid-block and of whole blocks, a 1-token query, queries across the kernel's blocks of 64
# tokens (64, 65, 130), score tiles of 32 keys (31, 32, 33), and a long prompt after a long prefix.
CTX_LENS = [5, 1, 40, 64, 65, 31, 32, 33, 130, 340]
Q_LENS = [5, 1, 1, 64, 60, 31, 17, 33, 130, 300]


def as_projected(batch: PagedBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This step's q, k, v as the model hands them over: views into one qkv row per token."""
    q, k, v = torch.cat(batch.q), batch.new_k(), batch.new_v()
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1).to(dtype)
    q, k, v = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return q.view(q.shape[0], -1, batch.q[0].shape[2]), k.view_as(batch.new_k()), v.view_as(batch.new_v())


def run_prefill(batch: PagedBatch, backend: TorchAttention, scale: float, dtype: torch.dtype) -> torch.Tensor:
    q, k, v = as_projected(batch, dtype)
    k_cache, v_cache = batch.k_cache.to(dtype), batch.v_cache.to(dtype)
    backend.store_kv(k, v, k_cache, v_cache, batch.slot_mapping())
    return backend.prefill(q, k, v, k_cache, v_cache, batch.prefill_meta(), scale)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (8, 8, 32), (4, 1, 5), (16, 2, 16)])
@pytest.mark.parametrize("build", BUILDS)
def test_prefill_kernel_matches_dense_attention(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                                                build: ctypes.CDLL):
    """Groups of 1-8 query heads (passes of 8 rows that mix tokens), and scores large enough (scale 2) that the
    softmax's maximum matters; there float32 scores are off by up to 1e-4 in torch too, so the bound is torch's."""
    batch = PagedBatch(CTX_LENS, Q_LENS, block_size, num_heads, num_kv_heads, head_dim)
    for scale in (head_dim**-0.5, 2.0):
        exact = batch.expected(scale)
        error = (run_prefill(batch, CpuAttention(build), scale, torch.float32) - exact).abs().max()
        torch_error = (run_prefill(batch, TorchAttention(), scale, torch.float32) - exact).abs().max()
        assert error <= max(2 * torch_error, 1e-5)


@pytest.mark.parametrize("build", BUILDS)
def test_bfloat16_prefill_kernel_is_as_close_as_torch(build: ctypes.CDLL) -> None:
    """bfloat16 in and out, float32 inside: no further from float64 than the torch backend is."""
    batch = PagedBatch(CTX_LENS, Q_LENS, 16, 9, 3, 64)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16().float(), batch.v_cache.bfloat16().float()
    batch.q = [q.bfloat16().float() for q in batch.q]
    batch.k, batch.v = [k.bfloat16().float() for k in batch.k], [v.bfloat16().float() for v in batch.v]
    out = run_prefill(batch, CpuAttention(build), 0.125, torch.bfloat16)
    reference = run_prefill(batch, TorchAttention(), 0.125, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    exact = batch.expected(0.125)
    assert (out.float() - exact).abs().max() <= (reference.float() - exact).abs().max() + 1e-3


def test_prefill_runs_the_kernel_where_it_applies_and_the_table_chooses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = CpuAttention.kernel_prefill
    monkeypatch.setattr(CpuAttention, "kernel_prefill", lambda self, q, *rest: calls.append(q.shape[0]) or kernel(
        self, q, *rest))
    batch = PagedBatch([20, 9], [12, 9], 4, 4, 2, 64)
    backend = CpuAttention()
    run_prefill(batch, backend, 0.125, torch.float32)
    assert calls == [21]
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "9-32"): "torch"})
    run_prefill(batch, backend, 0.125, torch.float32)
    # The class is the step's longest context (40: "33+"), not its query rows (5: "2-8"); the request whose own
    # context (9) the C kernel takes still runs in it.
    long_context = PagedBatch([40, 9], [3, 2], 4, 4, 2, 64)
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "33+"): "torch"})
    torch.testing.assert_close(run_prefill(long_context, backend, 0.125, torch.float32), long_context.expected(0.125),
                               atol=1e-4, rtol=1e-4)
    assert calls == [21, 2]
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "2-8"): "torch"})
    run_prefill(long_context, backend, 0.125, torch.float32)
    assert calls == [21, 2, 5]
    half = PagedBatch([20, 9], [12, 9], 4, 4, 2, 64)
    out = run_prefill(half, CpuAttention(), 0.125, torch.float16)  # no kernel for float16
    small = PagedBatch([20, 9], [12, 9], 4, 4, 2, 16)
    run_prefill(small, CpuAttention(), 0.125, torch.float32)  # nor for head_dim 16
    assert calls == [21, 2, 5]
    torch.testing.assert_close(out.float(), half.expected(0.125), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prompts_beside_a_long_one_keep_the_c_kernel(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Where the longest context chooses torch, each run of short requests (cached prefixes among them) takes one C
    call and the long ones go through torch, each into its own rows."""
    calls: list[int] = []
    kernel = CpuAttention.kernel_prefill
    monkeypatch.setattr(CpuAttention, "kernel_prefill", lambda self, q, *rest: calls.append(q.shape[0]) or kernel(
        self, q, *rest))
    batch = PagedBatch([300, 20, 40, 5, 270, 64], [280, 20, 10, 5, 270, 1], 16, 9, 3, 64)
    backend = CpuAttention()
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "prefill"): "torch"})
    out = run_prefill(batch, backend, 0.125, dtype)
    assert calls == [20 + 10 + 5, 1]
    reference = run_prefill(batch, TorchAttention(), 0.125, dtype)
    whole_step_in_c = run_prefill(batch, CpuAttention(), 0.125, dtype)
    exact = batch.expected(0.125)
    slack = 1e-3 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - exact).abs().max() <= (reference.float() - exact).abs().max() + slack
    long_rows = torch.cat([torch.arange(0, 280), torch.arange(315, 585)])
    short_rows = torch.cat([torch.arange(280, 315), torch.tensor([585])])
    assert torch.equal(out[long_rows], reference[long_rows])  # torch's rows are torch's own
    assert torch.equal(out[short_rows], whole_step_in_c[short_rows])  # and the kernel's its own, in their places
