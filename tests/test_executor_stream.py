"""The executor's StepStream pipelines: step N+1 runs while step N's result is still to be sent, results keep
their order, and a refused plan ends the stream with nothing sent after it applied."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import CallingThread, ExecutorServicer, build_server
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import EOS


class Recording(Executor):
    """A shadow executor noting each plan it starts and the thread it runs on; step ``slow_at`` takes a while."""

    def __init__(self, slow_at: int = -1) -> None:
        self.inner = ShadowExecutor(32, 4, 50, (EOS,))
        self.slow_at = slow_at
        self.ran: list[tuple[int, int]] = []
        self.changed = threading.Condition()

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        with self.changed:
            self.ran.append((plan.step_id, threading.get_ident()))
            self.changed.notify_all()
        if plan.step_id == self.slow_at:
            time.sleep(0.3)
        return self.inner.step(plan)

    def wait_for(self, n: int) -> bool:
        """Whether ``n`` steps have started within 10 s."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.ran) >= n, timeout=10)


class Aborted(Exception):
    """What the fake servicer context raises for ``abort``, as gRPC's does."""


class Context:
    """The part of ``grpc.ServicerContext`` the servicer uses."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def new_request(request_id: int, step_id: int) -> pb.StepPlan:
    request = pb.NewRequest(request_id=request_id, token_ids=[1, 2, 3], block_table=[request_id],
                            num_scheduled_tokens=3, sampling=pb.SamplingParams(temperature=0))
    return pb.StepPlan(step_id=step_id, is_prefill=True, new_requests=[request])


def unknown_request(step_id: int) -> pb.StepPlan:
    cached = pb.CachedRequests(request_ids=[99], num_computed_tokens=[3], num_scheduled_tokens=[1], num_new_blocks=[0])
    return pb.StepPlan(step_id=step_id, cached_requests=cached)


def taken(plans: list[pb.StepPlan], done: threading.Event) -> Iterator[pb.StepPlan]:
    """``plans``, then ``done`` set once the stream's reader asks for one more: it has handed every plan on."""
    yield from plans
    done.set()


def wait_all_handed_on(done: threading.Event, calling: CallingThread) -> None:
    """Wait until the stream's reader has handed on every plan and the calling thread has run all it was given."""
    assert done.wait(10), "the stream's reader never took every plan"
    calling.submit(lambda: None).result(timeout=10)


@pytest.fixture
def calling_thread() -> Iterator[tuple[CallingThread, threading.Thread]]:
    calling = CallingThread()
    runner = threading.Thread(target=calling.run)
    runner.start()
    yield calling, runner
    calling.stop()
    runner.join(timeout=5)


def test_the_next_step_runs_while_a_result_waits_to_be_taken(calling_thread):
    calling, runner = calling_thread
    executor = Recording()
    results = ExecutorServicer(executor, calling.submit).StepStream(iter([new_request(i, i) for i in range(4)]),
                                                                     Context())
    assert next(results).step_id == 0
    assert executor.wait_for(4), "the steps after the first waited for its result to be taken"
    assert [r.step_id for r in results] == [1, 2, 3]
    assert executor.ran == [(i, runner.ident) for i in range(4)], "steps ran out of order or off the calling thread"


def test_a_refused_plan_ends_the_stream_and_no_plan_after_it_runs(calling_thread):
    calling, _ = calling_thread
    executor = Recording(slow_at=1)
    plans, done = [new_request(0, 0), unknown_request(1), new_request(2, 2)], threading.Event()
    results = ExecutorServicer(executor, calling.submit).StepStream(taken(plans, done), Context())
    assert next(results).step_id == 0
    with pytest.raises(Aborted) as refused:
        next(results)
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    wait_all_handed_on(done, calling)  # the third plan, queued during the slow second step, had its turn
    assert [step_id for step_id, _ in executor.ran] == [0, 1]
    assert set(executor.inner.table.requests) == {0}


def test_over_grpc_errors_end_the_stream_and_a_reset_after_a_cancel_waits_for_the_step_in_flight(calling_thread):
    calling, _ = calling_thread
    executor = Recording(slow_at=1)
    server, port = build_server(executor, "127.0.0.1", 0, submit=calling.submit)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExecutorStub(channel)
            responses = stub.StepStream(iter([new_request(0, 0), unknown_request(1), new_request(2, 2)]), timeout=10)
            assert next(responses).step_id == 0
            with pytest.raises(grpc.RpcError) as refused:
                next(responses)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "unknown" in refused.value.details()
            assert set(executor.inner.table.requests) == {0}

            plans = iter([new_request(1, 1), new_request(3, 3)])
            cancelled = stub.StepStream(plans, timeout=10)
            assert executor.wait_for(3)  # the slow step 1 has started
            cancelled.cancel()
            # Reset is queued behind the step in flight, so it drops the request that step added.
            assert stub.Reset(pb.ResetRequest(), timeout=10).num_dropped_requests >= 2
            assert len(executor.inner.table) == 0
            again = stub.StepStream(iter([new_request(5, 7)]), timeout=10)
            assert [r.step_id for r in again] == [7]
    finally:
        server.stop(None)


class SlowFirst(ShadowExecutor):
    """A shadow executor in two halves (it prepares ahead) whose first step runs a while."""

    def execute(self, prepared):
        if prepared.step_id == 0:
            time.sleep(0.3)
        return super().execute(prepared)


def test_a_plan_refused_while_prepared_ahead_ends_the_stream_after_the_steps_before_it(calling_thread):
    calling, _ = calling_thread
    executor = SlowFirst(32, 4, 50, (EOS,))
    assert executor.prepares_ahead
    plans, done = [new_request(0, 0), new_request(1, 1), unknown_request(2), new_request(3, 3)], threading.Event()
    results = ExecutorServicer(executor, calling.submit).StepStream(taken(plans, done), Context())
    assert [next(results).step_id, next(results).step_id] == [0, 1], "steps queued before the refusal still ran"
    with pytest.raises(Aborted) as refused:
        next(results)
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    wait_all_handed_on(done, calling)
    assert set(executor.table.requests) == {0, 1}, "no plan after the refused one was applied"
