"""The CPU KV cache and the packed weights ask for 2 MiB pages: zeroed memory on a 2 MiB boundary, whatever its
size, the packed weights one after another in the order a step reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.huge_pages import HUGE_PAGE_BYTES, slices_on_huge_pages, zeros_on_huge_pages
from executor_svc.layers.linear import ColumnParallelLinear, prepack_for_cpu
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from tests.model_fixtures import tiny_model_folders  # noqa: F401


@pytest.mark.parametrize(("shape", "dtype"), [
    ((2, 4, 300, 16, 3, 64), torch.float32),  # many huge pages and a partial one
    ((2, 1, 5, 16, 2, 16), torch.bfloat16),  # less than one
    ((0, 16), torch.float32),
])
def test_zeroed_on_a_huge_page_boundary(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    cache = zeros_on_huge_pages(shape, dtype)
    assert (cache.shape, cache.dtype, cache.is_contiguous()) == (torch.Size(shape), dtype, True)
    assert cache.numel() == 0 or cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not cache.any()
    cache.fill_(1)  # writable to its last element
    assert cache.sum().item() == cache.numel()


def test_the_cpu_executor_keeps_its_kv_cache_there(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(tiny_model_folders["llama"]),
                                             kv_cache_memory=8 << 20, threads=1))
    cache = executor.runner.kv_cache
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert cache.shape[2] == executor.get_info().num_blocks and not cache.any()


def test_slices_follow_one_another_on_64_byte_boundaries() -> None:
    sizes = [5, 64, 0, 130, 3 << 20]
    slices = slices_on_huge_pages(sizes)
    assert [s.numel() for s in slices] == sizes and slices[0].data_ptr() % HUGE_PAGE_BYTES == 0
    filled = [s for s in slices if s.numel()]  # an empty tensor has no address of its own
    for previous, part in zip(filled, filled[1:], strict=False):
        end = previous.data_ptr() + previous.numel()
        assert part.data_ptr() % 64 == 0 and end <= part.data_ptr() < end + 64
    assert not any(s.any() for s in slices)
    for i, part in enumerate(slices):
        part.fill_(i + 1)  # no two overlap: each keeps its own value
    assert all(bool((part == i + 1).all()) for i, part in enumerate(slices))


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels")
def test_a_models_packed_weights_lie_in_one_region_in_layer_order() -> None:
    layers = torch.nn.Sequential(*(ColumnParallelLinear(64, [48 * (i + 1)]) for i in range(4)))
    for layer in layers:
        layer.weight.data.normal_()
    dense = [layer.weight.detach().clone() for layer in layers]
    prepack_for_cpu(layers, c_kernel=True, torch_copy=False)
    starts = [layer.packed_weight.data.data_ptr() for layer in layers]
    assert starts[0] % HUGE_PAGE_BYTES == 0 and starts == sorted(starts)
    x = torch.randn(3, 64)
    for layer, weight in zip(layers, dense, strict=True):
        torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-4, rtol=1e-4)
