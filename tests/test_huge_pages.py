"""The CPU KV cache asks for 2 MiB pages: a zeroed tensor on a 2 MiB boundary, whatever its size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.cpu.huge_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages
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
