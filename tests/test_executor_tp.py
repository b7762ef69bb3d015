"""Tensor parallelism over gloo on CPU: two ranks give the same greedy tokens as one, and run one kernel table."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from executor_svc.cpu import probe as kernel_probe
from executor_svc.cpu.choice import KernelChoice
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.distributed import free_init_method, init_group
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.model_runner import ModelRunner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_model_parity import random_prompts


def generate(folder: Path, tp: int, prompts: list[list[int]]) -> list[list[int]]:
    options = ExecutorOptions(
        dtype="float32", model=str(folder), tensor_parallel_size=tp, block_size=8, kv_cache_memory=8 << 20, threads=1
    )
    executor = ModelExecutor(options)
    try:
        assert executor.get_info().tensor_parallel_size == tp
        # A small token budget adds chunked prefill with cached context to the batched decode.
        engine = Engine(executor, SchedulerConfig(max_num_batched_tokens=48))
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        return [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        executor.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_two_ranks_match_one(tiny_model_folders: dict[str, Path], family: str) -> None:  # noqa: F811
    prompts = random_prompts(7)
    assert generate(tiny_model_folders[family], 2, prompts) == generate(tiny_model_folders[family], 1, prompts)


def kernels_on_rank(rank: int, world: int, init_method: str, folder: str, tables: multiprocessing.Queue) -> None:
    init_group(rank, world, init_method, torch.device("cpu"))
    # Ranks whose measurements disagree, as two ranks racing near-equal kernels at once can.
    way = "c" if rank == 0 else "torch"
    kernel_probe.measure = lambda *_: KernelChoice.uniform(way, source=f"measured on rank {rank}")
    options = ExecutorOptions(dtype="float32", model=folder, tensor_parallel_size=world, block_size=8,
                              kv_cache_memory=8 << 20,
                              threads=1)
    kernels = ModelRunner(folder, options).kernels
    tables.put((rank, kernels.source, kernels.table))


def test_ranks_run_and_cache_rank_0s_kernel_table(
    tiny_model_folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    ctx, init_method = multiprocessing.get_context("spawn"), free_init_method()
    tables = ctx.Queue()
    ranks = [ctx.Process(target=kernels_on_rank, args=(rank, 2, init_method, str(tiny_model_folders["qwen2"]), tables))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        seen = dict((rank, (source, table)) for rank, source, table in (tables.get(timeout=120) for _ in ranks))
    finally:
        for process in ranks:
            process.join(timeout=30)
            process.kill()
    assert seen[0] == seen[1] and seen[0][0] == "measured on rank 0"
    [cached] = (tmp_path / "kernels").glob("kernel-choice-*.json")
    assert KernelChoice.from_json(cached.read_text(), "test").table == KernelChoice.uniform("c").table
