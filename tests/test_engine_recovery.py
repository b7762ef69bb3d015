"""An executor that dies mid-generation loses nothing: the engine recomputes on the new one."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from common.step import LoraAdapterInfo
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine, IncompatibleExecutor
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import ConnectionLost, RestartingExecutor, expected, run_with_recovery


def restarting_shadow(die_at: set[int], sizes: list[int]) -> RestartingExecutor:
    """Dies at the given steps and comes back as a fresh shadow executor of the next size (new instance id)."""
    left = list(sizes)
    return RestartingExecutor(lambda: ShadowExecutor(left.pop(0), 4, 50, (EOS,)), die_at)


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("die_at", [{1}, {3, 4}, {6}, {2, 9, 15}])
def test_requests_survive_executor_restarts_with_identical_tokens(die_at, overlap, policy):
    executor = restarting_shadow(die_at, [40, 24, 64, 32, 48])
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, policy=policy)
    engine = Engine(executor, config, overlap=overlap)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True) for _ in prompts]
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    assert executor.restarts == len(die_at)
    for prompt, p, seq in zip(prompts, params, seqs, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, p)
    assert engine.info.num_blocks == executor.inner.info.num_blocks, "the block manager follows the new executor"
    assert_all_blocks_free(engine.block_manager)
    assert len(executor.inner.table) == 0


def test_seeded_sampling_survives_a_restart():
    executor = restarting_shadow({5}, [40, 40])
    engine = Engine(executor, SchedulerConfig(8, 64))
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)] * 2
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    for prompt, p, seq in zip(prompts, params, seqs, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, p)
    assert_all_blocks_free(engine.block_manager)
    assert len(executor.inner.table) == 0


def test_requests_too_large_for_the_new_cache_are_aborted():
    executor = restarting_shadow({2}, [40, 6])
    engine = Engine(executor, SchedulerConfig(8, 64))
    small = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    large = engine.add_request(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ConnectionLost):
        engine.step()
    assert engine.recover() == ([], [large])
    assert large.is_finished and large.finish_reason.value == "abort"
    run_with_recovery(engine)
    assert small.is_finished and small.num_completion_tokens == 4
    assert_all_blocks_free(engine.block_manager)


def test_requests_through_an_adapter_the_restarted_executor_lacks_are_aborted():
    # An adapter loaded at run time is gone with the executor: its requests end, the others carry on.
    executor = restarting_shadow({2}, [40, 40])
    executor.inner.info = replace(executor.inner.info, lora_adapters=(LoraAdapterInfo(1, "a1"),), max_lora_rank=8)
    executor.inner.table.lora_ids = {1}
    engine = Engine(executor, SchedulerConfig(8, 64))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base, tuned = engine.add_request([1, 2, 3], params), engine.add_request([4, 5, 6], params, lora="a1")
    engine.step()
    with pytest.raises(ConnectionLost):
        engine.step()
    assert engine.recover() == ([tuned], [])
    assert tuned.is_finished and tuned.finish_reason.value == "abort"
    run_with_recovery(engine)
    assert base.completion_token_ids == expected(engine, [1, 2, 3], params)
    assert_all_blocks_free(engine.block_manager)


def test_an_executor_with_another_model_is_refused():
    executor = restarting_shadow({2}, [40, 40])
    engine = Engine(executor, SchedulerConfig(8, 64))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    executor.vocab_size = 60
    executor.die_at.add(2)
    with pytest.raises(ConnectionLost):
        engine.step()
    executor.inner = ShadowExecutor(40, 4, 60, (EOS,))
    with pytest.raises(IncompatibleExecutor, match="vocab 60"):
        engine.recover()
    (seq,) = [*engine.scheduler.waiting, *engine.scheduler.running]
    engine.abort(seq)
    assert_all_blocks_free(engine.block_manager)
