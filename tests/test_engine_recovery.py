"""An executor that dies mid-generation loses nothing: the engine recomputes on the new one."""

from __future__ import annotations

import random

import pytest

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine, ExecutorRestarted, IncompatibleExecutor
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import expected


class ConnectionLost(RuntimeError):
    """What a killed executor process looks like to the engine."""


class RestartingExecutor(Executor):
    """Dies at the given steps and comes back as a fresh executor (new instance id, maybe new size)."""

    def __init__(self, die_at: set[int], sizes: list[int], block_size: int = 4, vocab_size: int = 50) -> None:
        self.die_at, self.sizes = die_at, list(sizes)
        self.block_size, self.vocab_size = block_size, vocab_size
        self.inner = self._fresh()
        self.steps = 0
        self.restarts = 0

    def _fresh(self) -> ShadowExecutor:
        return ShadowExecutor(self.sizes.pop(0), self.block_size, self.vocab_size, (EOS,))

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        if self.steps in self.die_at:
            self.inner = self._fresh()
            self.restarts += 1
            raise ConnectionLost("executor process killed")
        return self.inner.step(plan)


def run_with_recovery(engine: Engine) -> None:
    while engine.has_unfinished():
        try:
            engine.step()
        except (ConnectionLost, ExecutorRestarted):
            assert engine.recover() == []
    engine.step()


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("die_at", [{1}, {3, 4}, {6}, {2, 9, 15}])
def test_requests_survive_executor_restarts_with_identical_tokens(die_at, overlap, policy):
    executor = RestartingExecutor(die_at, sizes=[40, 24, 64, 32, 48])
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
    executor = RestartingExecutor({5}, sizes=[40, 40])
    engine = Engine(executor, SchedulerConfig(8, 64))
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)] * 2
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    for prompt, p, seq in zip(prompts, params, seqs, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, p)


def test_requests_too_large_for_the_new_cache_are_aborted():
    executor = RestartingExecutor({2}, sizes=[40, 6])
    engine = Engine(executor, SchedulerConfig(8, 64))
    small = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    large = engine.add_request(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ConnectionLost):
        engine.step()
    assert engine.recover() == [large]
    assert large.is_finished and large.finish_reason.value == "abort"
    run_with_recovery(engine)
    assert small.is_finished and small.num_completion_tokens == 4
    assert_all_blocks_free(engine.block_manager)


def test_an_executor_with_another_model_is_refused():
    executor = RestartingExecutor({2}, sizes=[40, 40])
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
