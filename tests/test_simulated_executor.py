"""The simulated accelerator of W5: the real executor's plan handling, a fixed wait for the device's part."""

from __future__ import annotations

import time

import pytest

from executor_svc.requests import PlanError
from executor_svc.simulated import SimulatedExecutor, parse_args, simulated_executor
from nanoserve.v1 import executor_pb2 as pb
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams


def executor(step_ms: float = 2.0) -> SimulatedExecutor:
    return simulated_executor(parse_args(["--step-ms", str(step_ms), "--num-blocks", "64", "--block-size", "4",
                                          "--vocab-size", "50", "--eos-token-ids", "0,1"]))


def test_every_step_waits_and_samples_a_token_that_is_no_eos():
    simulated = executor(step_ms=2.0)
    engine = Engine(simulated)
    started = time.perf_counter()
    outputs = engine.generate([[5, 6, 7], [8] * 9], SamplingParams(temperature=0, max_tokens=4))
    # One prefill and three decode steps of both sequences, each at least one wait.
    assert time.perf_counter() - started >= 4 * 2e-3
    assert [o.token_ids for o in outputs] == [[2] * 4, [2] * 4]
    assert len(simulated.table) == 0


def test_a_refused_plan_changes_nothing():
    simulated = executor(step_ms=0.0)
    new = pb.NewRequest(request_id=3, token_ids=[5, 6], block_table=[64], num_scheduled_tokens=2)
    with pytest.raises(PlanError) as refused:
        simulated.step(pb.StepPlan(is_prefill=True, new_requests=[new]))
    assert refused.value.code == "INVALID_ARGUMENT" and len(simulated.table) == 0


def test_a_negative_wait_is_refused():
    with pytest.raises(SystemExit):
        executor(step_ms=-1.0)
