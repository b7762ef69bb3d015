"""The engine's executor, recorded: every call the engine makes goes through to it unchanged, and what a replay needs
goes to the ``Recorder`` on the way (``engine.recorder``), whichever way the engine calls it (``step``, ``submit``
down a stream, or ``prepare`` and ``execute`` on two threads)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from nanoserve.v1 import recording_pb2 as rpb
from scheduler_svc.engine.executor_client import describe_failure
from scheduler_svc.engine.recorder import Recorder


@dataclass(slots=True)
class Prepared:
    """The inner executor's prepared step, and the plan's step id when it was recorded."""

    inner: object
    recorded_step_id: int | None


class RecordingExecutor(Executor):
    """``inner`` as the engine sees it, with its handshakes, plans, results, failures and resets recorded while
    ``recorder`` is active."""

    def __init__(self, inner: Executor, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder
        self.streams = inner.streams
        self.prepares_ahead = inner.prepares_ahead
        self._info: ExecutorInfo | None = None

    def get_info(self) -> ExecutorInfo:
        self._info = info = self.inner.get_info()
        self.recorder.handshake(info)
        return info

    def reset(self) -> int:
        """The reset; a session that was to begin begins here, from the empty executor."""
        dropped = self.inner.reset()
        if self.recorder.pending:
            self.recorder.begin(self._info or self.inner.get_info(), dropped)
        else:
            self.recorder.put("reset", rpb.ExecutorReset(num_dropped_requests=dropped))
        return dropped

    def cut(self, step_id: int) -> None:
        """A cut shows in the recording as the result's num_passes."""
        self.inner.cut(step_id)

    def _plan(self, plan: StepPlan) -> int | None:
        """Record ``plan``; its step id when recorded (its outcome is then recorded too)."""
        if not self.recorder.active:
            return None
        self.recorder.put("plan", plan)
        return plan.step_id

    def _failed(self, step_id: int | None, error: BaseException) -> None:
        if step_id is not None:
            self.recorder.put("failure", rpb.StepFailure(step_id=step_id, error=describe_failure(error)))

    def _answered(self, step_id: int | None, result: StepResult) -> None:
        if step_id is not None:
            self.recorder.put("result", result)

    def step(self, plan: StepPlan) -> StepResult:
        step_id = self._plan(plan)
        try:
            result = self.inner.step(plan)
        except Exception as e:
            self._failed(step_id, e)
            raise
        self._answered(step_id, result)
        return result

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        step_id = self._plan(plan)
        future = self.inner.submit(plan)
        if step_id is not None:
            future.add_done_callback(partial(self._outcome, step_id))
        return future

    def _outcome(self, step_id: int, future: Future[StepResult]) -> None:
        """A submitted plan's result or failure, on whichever thread resolved it."""
        error = future.exception() if not future.cancelled() else ConnectionError("the step was cancelled")
        if error is not None:
            self._failed(step_id, error)
        else:
            self._answered(step_id, future.result())

    def prepare(self, plan: StepPlan) -> Prepared:
        step_id = self._plan(plan)
        try:
            return Prepared(self.inner.prepare(plan), step_id)
        except Exception as e:
            self._failed(step_id, e)
            raise

    def execute(self, prepared: Prepared) -> StepResult:
        try:
            result = self.inner.execute(prepared.inner)
        except Exception as e:
            self._failed(prepared.recorded_step_id, e)
            raise
        self._answered(prepared.recorded_step_id, result)
        return result
