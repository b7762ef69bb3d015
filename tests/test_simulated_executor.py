"""The simulated accelerator of W5: the real executor's plan handling, a fixed wait for the device's part."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from common.step import NewRequest, StepPlan
from executor_svc.core.request_table import PlanError
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.fakes.simulated import SPIN_S, SimulatedExecutor, accelerator_wait, parse_args, simulated_executor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free


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
    assert_all_blocks_free(engine.block_manager)


def test_a_refused_plan_changes_nothing():
    simulated = executor(step_ms=0.0)
    new = NewRequest(request_id=3, token_ids=[5, 6], block_table=[64], num_scheduled_tokens=2)
    with pytest.raises(PlanError) as refused:
        simulated.step(StepPlan(is_prefill=True, new_requests=[new]))
    assert refused.value.code == "INVALID_ARGUMENT" and len(simulated.table) == 0


def test_a_negative_wait_is_refused():
    with pytest.raises(SystemExit):
        executor(step_ms=-1.0)


needs_spin = pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler to build the spin")


@needs_spin
@pytest.mark.parametrize("seconds", [SPIN_S / 3, 4 * SPIN_S])
def test_the_wait_never_ends_early(seconds: float):
    deadline = time.perf_counter() + seconds
    accelerator_wait(deadline)
    assert time.perf_counter() >= deadline


@needs_spin
def test_the_spin_lets_python_run_beside_it():
    """The spin that ends each wait releases the GIL, as a CUDA synchronize does: another thread's Python runs.

    The GIL is never taken from a thread that holds it here (a switch interval of 10 s): the counter counts only
    while this thread lets go of it, and it lets go of it each count (``time.sleep(0)``)."""
    done, count = threading.Event(), [0]

    def counting() -> None:
        while not done.is_set():
            count[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    counter = threading.Thread(target=counting)
    try:
        counter.start()
        while count[0] == 0:
            time.sleep(0.001)
        before = count[0]
        cpu_kernels.kernel_library().spin_until(time.perf_counter() + 0.02)
        after = count[0]
    finally:
        done.set()
        counter.join()
        sys.setswitchinterval(interval)
    assert after > before


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
def test_a_multi_step_plan_launches_each_pass_from_the_one_before_and_stops_where_cut(cut):
    """Eight passes on the simulated device, each launched behind the one before, before its tokens reach the host;
    cut, the plan stops after its first pass and the next plan starts there."""
    simulated = executor(step_ms=2.0)
    engine = Engine(simulated, SchedulerConfig(num_scheduler_steps=8))
    seqs = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))
            for prompt in ([5, 6, 7], [8] * 9)]
    engine.step()  # the prefill
    launches = []
    original = simulated.launch

    def launch(chunks, inputs=None, sampled_before=None, behind=None):
        launched = original(chunks, inputs, sampled_before, behind)
        launches.append("behind" if behind is not None else "from tokens" if sampled_before is not None else "alone")
        return launched

    simulated.launch = launch
    if cut:
        simulated.cut(engine.planner.step_id + 1)  # the next plan's
    outputs = engine.step()
    assert [len(o.token_ids) for o in outputs] == ([1, 1] if cut else [8, 8])
    if not cut:
        # Greedy, each pass samples on the device: the next is queued behind it before its tokens reach the host.
        assert launches == ["alone"] + ["behind"] * 7
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert [seq.completion_token_ids for seq in seqs] == [[2] * 17] * 2
    assert len(simulated.table) == 0
    assert_all_blocks_free(engine.block_manager)
