"""Tensor parallelism over gloo on CPU: two ranks give the same greedy tokens as one."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.config import ExecutorOptions
from executor_svc.model_executor import ModelExecutor
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import SchedulerConfig
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_model_parity import random_prompts


def generate(folder: Path, tp: int, prompts: list[list[int]]) -> list[list[int]]:
    options = ExecutorOptions(
        model=str(folder), tensor_parallel_size=tp, block_size=8, kv_cache_memory=8 << 20, threads=1
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
