"""A step on its way to the executor, as the ``Engine`` keeps it until it collects the result."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from common.executor import Executor
from common.step import StepPlan, StepResult
from scheduler_svc.core.step_record import StepRecord

Submit = Callable[[StepPlan], Future[StepResult]]


def submitter(executor: Executor) -> tuple[Submit, ThreadPoolExecutor | None]:
    """Sends a plan without waiting for its result: the executor's own ordered stream when it has one, else one
    worker thread (which keeps order; returned too). An executor that ``prepares_ahead`` (its step in two halves,
    ``prepare`` and ``execute``: ``executor_svc.core.step_pipeline``) gets a second thread that prepares each plan as
    it comes, while the worker still executes the one before."""
    if executor.streams:
        return executor.submit, None
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor")
    if not executor.prepares_ahead:
        return (lambda plan: worker.submit(executor.step, plan)), worker
    prepare, execute = executor.prepare, executor.execute
    packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-prepare")

    def submit(plan: StepPlan) -> Future[StepResult]:
        return worker.submit(lambda prepared: execute(prepared.result()), packer.submit(prepare, plan))

    return submit, worker


@dataclass
class StepTimings:
    """Wall seconds of each phase of the last step: what the split costs per step."""

    schedule_s: float = 0.0
    plan_s: float = 0.0
    execute_s: float = 0.0
    postprocess_s: float = 0.0


@dataclass(slots=True)
class Launched:
    """A step sent to the executor: its booking and its result (a future while it runs)."""

    record: StepRecord
    plan: StepPlan
    # A decode of more than one step per sequence: the executor can cut it short.
    window: bool
    result: Future[StepResult] | StepResult
    schedule_s: float
    plan_s: float
    # Time spent handing the plan over: the whole call for a synchronous executor.
    send_s: float
    # Booked on a window that was cut: the executor drops it, and its booking is given back.
    dropped: bool = False
