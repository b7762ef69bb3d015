"""Results that answer the wrong step, hung steps under overlap, and a hung executor's handshake."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import build_server
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine, StepMismatch
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import expected

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Wrapped(Executor):
    """A shadow executor, to override one call of."""

    def __init__(self) -> None:
        self.inner = ShadowExecutor(32, 4, 50, (EOS,))

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        return self.inner.step(plan)


class StaleResults(Wrapped):
    """Answers one step with the result of the step before it, as a stream that lost its order would."""

    def __init__(self, stale_at: int) -> None:
        super().__init__()
        self.stale_at, self.steps = stale_at, 0

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        result = self.inner.step(plan)
        if self.steps == self.stale_at:
            result.step_id -= 1
        return result


def test_a_result_for_another_step_is_refused_and_recovery_keeps_the_tokens():
    executor = StaleResults(stale_at=3)
    engine = Engine(executor)
    seq = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    with pytest.raises(StepMismatch, match="answered step 2 where step 3 was due"):
        while engine.has_unfinished():
            engine.step()
    assert engine.recover() == ([], [])
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert seq.completion_token_ids == expected(engine, [1, 2, 3, 4, 5], GREEDY)
    assert_all_blocks_free(engine.block_manager)


class Hung(Future):
    """A step's result that never comes; it counts the engine's waits on it."""

    def __init__(self, waits: list[float | None]) -> None:
        super().__init__()
        self.waits = waits

    def result(self, timeout: float | None = None) -> StepResult:
        self.waits.append(timeout)
        return super().result(timeout)


class HangingStream(Wrapped):
    """An executor with its own ordered stream (like ``RemoteExecutor``) whose steps hang from ``hang_at`` on, until
    the next reset; ``waits`` holds the timeout of every wait on a hung step.

    Its reset returns at once, as a remote reset that cancels the stream does.
    """

    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self.hang_at, self.steps, self.hanging = hang_at, 0, True
        self.waits: list[float | None] = []

    streams = True

    def reset(self) -> int:
        self.hanging = False
        return super().reset()

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        self.steps += 1
        if self.hanging and self.steps >= self.hang_at:
            return Hung(self.waits)
        future: Future[StepResult] = Future()
        future.set_result(self.inner.step(plan))
        return future


def test_a_hung_step_under_overlap_costs_one_step_timeout_before_recovery():
    timeout = 1.0
    executor = HangingStream(hang_at=3)
    engine = Engine(executor, overlap=True, step_timeout_s=timeout)
    seq = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        while engine.has_unfinished():
            engine.step()
    failed = time.monotonic()
    assert engine.recover() == ([], [])
    recovered = time.monotonic()
    assert executor.steps > executor.hang_at, "no step was queued behind the hung one"
    assert executor.waits == [timeout], "the engine waited on more than the first hung step"
    # Each bound is the least a second step timeout would cost: a loaded machine's delays stay far below it.
    assert failed - started < 2 * timeout, "a second step timeout before the failure"
    assert recovered - failed < timeout, "recovery waited for the step queued behind the hung one"
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert seq.completion_token_ids == expected(engine, [1, 2, 3, 4, 5], GREEDY)
    assert_all_blocks_free(engine.block_manager)


class SlowWindow(Wrapped):
    """An in-process executor whose first multi-step decode outlasts the step timeout; it notes a reset that came
    while a step still ran on its thread (an in-process executor is not safe to reset then)."""

    def __init__(self) -> None:
        super().__init__()
        self.slowed = self.running = self.reset_while_running = False

    def step(self, plan: StepPlan) -> StepResult:
        slow = not self.slowed and max(plan.cached_requests.num_decode_steps, default=1) > 1
        self.slowed |= slow
        self.running = True
        try:
            time.sleep(0.45 if slow else 0)  # past the timeout, within the one more the reset waits
            return self.inner.step(plan)
        finally:
            self.running = False

    def reset(self) -> int:
        self.reset_while_running |= self.running
        return self.inner.reset()


def test_recovery_from_a_timed_out_window_lets_an_in_process_executor_finish_it_before_the_reset():
    executor = SlowWindow()
    engine = Engine(executor, SchedulerConfig(num_scheduler_steps=8), overlap=True, step_timeout_s=0.3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seq = engine.add_request([1, 2, 3], params)
    engine.cut_for_loop()  # the loop has work on its way in: nothing is booked on the window, which is collected alone
    with pytest.raises(TimeoutError):
        while engine.has_unfinished():
            engine.step()
    engine.loop_work_taken()
    assert engine.recover() == ([], [])
    assert not executor.reset_while_running, "the executor was reset while it still ran the window"
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert seq.completion_token_ids == expected(engine, [1, 2, 3], params)
    assert_all_blocks_free(engine.block_manager)


class HangingInfo(Wrapped):
    """Serves GetInfo once, then hangs on it until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calls = 0

    def get_info(self) -> ExecutorInfo:
        self.calls += 1
        if self.calls > 1:
            self.release.wait(30)
        return self.inner.get_info()


def test_the_idle_probe_has_its_own_short_deadline_not_the_step_timeout():
    executor = HangingInfo()
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    remote = RemoteExecutor(f"127.0.0.1:{port}", step_timeout_s=60, info_timeout_s=0.5)
    try:
        engine = Engine(remote)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as hung:
            engine.probe()
        assert hung.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5, "the probe waited for the step timeout"
    finally:
        executor.release.set()
        remote.close()
        server.stop(0)


def test_a_probe_deadline_never_outlasts_the_step_timeout():
    assert RemoteExecutor("127.0.0.1:1", step_timeout_s=1.0).info_timeout_s == 1.0
    assert RemoteExecutor("127.0.0.1:1", step_timeout_s=60.0).info_timeout_s == 5.0
