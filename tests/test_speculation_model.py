"""Greedy float32 on the embedded SmolLM2 through the scheduler's engine: speculation on (n-gram, and an early-exit
draft of the model's first layers) gives exactly the tokens of speculation off, with overlap and windows, prefix
hits and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import smollm2_folder  # noqa: F401

# Copy-heavy prompts (a list to repeat), one sharing the other's prefix, one longer than the chunk budget.
LIST = [330, 1345, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28, 9104, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28]
PROMPTS = [LIST, LIST + [9104, 28], [1, 2, 3, 4, 5, 6, 7, 8] * 5]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_float32_output_with_speculation_equals_without(smollm2_folder: Path, method: str):  # noqa: F811
    draft = {"speculative_draft_layers": 12} if method == "draft" else {}
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(smollm2_folder), block_size=4,
                                             kv_cache_memory=24 << 20, threads=2, **draft))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = [c.token_ids for c in Engine(executor).generate(PROMPTS, params)]
    ngram = dict(ngram_min=2, ngram_max=4) if method == "ngram" else {}
    config = SchedulerConfig(max_num_batched_tokens=32, num_scheduler_steps=8, speculative=method,
                             num_speculative_tokens=4, **ngram)
    engine = Engine(executor, config, overlap=True)
    on = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert on == off
    counters = engine.scheduler.speculator.counters
    assert counters.num_drafts > 0
    if method == "ngram":  # the list repeats: its proposals are accepted (a 12-layer early exit's may all miss)
        assert counters.num_accepted_tokens > 0
    assert_all_blocks_free(engine.block_manager)
