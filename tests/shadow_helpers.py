"""Helpers for driving the engine over the shadow-KV executor in tests."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection

import numpy as np

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.fakes.shadow import HIT, ShadowExecutor, next_token, reference_generate
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine, ExecutorRestarted, FinishedRequest
from tests.conftest import EOS


class ConnectionLost(RuntimeError):
    """What a killed executor process looks like to the engine."""


class RestartingExecutor(Executor):
    """Dies at each of its ``die_at`` steps (1-based) and comes back as ``make()``: a new instance that holds
    nothing (``restarts`` counts the deaths)."""

    def __init__(self, make: Callable[[], Executor], die_at: Collection[int]) -> None:
        self.make, self.die_at = make, die_at
        self.inner = make()
        self.steps = 0
        self.restarts = 0

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        if self.steps in self.die_at:
            self.inner = self.make()
            self.restarts += 1
            raise ConnectionLost("executor process killed")
        return self.inner.step(plan)


class RecordingExecutor(Executor):
    """Wraps an executor and keeps a copy of every plan it runs."""

    def __init__(self, inner: ShadowExecutor) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(copy.deepcopy(plan))
        return self.inner.step(plan)

    def reset(self) -> int:
        return self.inner.reset()

    @property
    def table(self):
        return self.inner.table


def run_with_recovery(engine: Engine) -> None:
    """Run every request to its end, recovering each time the executor is lost (nothing may be dropped), then send
    the last finished ids."""
    while engine.has_unfinished():
        try:
            engine.step()
        except (ConnectionLost, ExecutorRestarted):
            assert engine.recover() == ([], [])
    engine.step()


def expected(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    info = engine.info
    return reference_generate(
        prompt, params.max_tokens, info.vocab_size, {EOS}, params.ignore_eos, params.seed, info.max_model_len
    )


def assert_matches_reference(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                             outputs: list[FinishedRequest]) -> None:
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs, strict=True)):
        assert out.token_ids == expected(engine, prompt, p), f"request {i} diverged from the sequential reference"


def shadow_prompt_logprobs(prompt: list[int], vocab: int, top: int) -> list[tuple[float, list[int]]]:
    """What the shadow's model gives each prompt token from the second on: (its logprob, the top ids)."""
    hit, miss = math.log(HIT), math.log((1 - HIT) / (vocab - 1))
    out = []
    for p in range(1, len(prompt)):
        likeliest = next_token(np.array(prompt[:p]), vocab, None)
        top_ids = [likeliest, *(t for t in range(vocab) if t != likeliest)][:top]
        out.append((hit if prompt[p] == likeliest else miss, top_ids))
    return out
