"""A step on its way to the executor, as the ``Engine`` keeps it until it collects the result."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from common.step import StepPlan, StepResult
from scheduler_svc.core.step_record import StepRecord


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
