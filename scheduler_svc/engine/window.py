"""The multi-step decode window, on the scheduler's side: which one is in flight, when it is cut, what a cut gives
back.

A decode of more than one step per sequence (a window) runs on the executor as several passes. The engine books
the next plan on every pass of the window in flight (StepPlan.after_whole_step_id), so the executor never waits.
Work the loop must do before the next plan (an arrival's prefill, a cancel) cuts the window short: the executor's
CutStep stops it after the pass in progress and drops the plan booked on it, and ``give_back`` returns that plan's
booking to the scheduler and the planner, so the next plan starts from the passes that ran. No window is booked
ahead while a request waits: the next step may be its prefill. The executor's half is
``executor_svc.core.step_pipeline``.
"""

from __future__ import annotations

from common.executor import Executor
from common.step import StepPlan
from scheduler_svc.core.planner import Planner
from scheduler_svc.core.scheduler import Scheduler, StepRecord


class Window:
    """The window in flight, and whether the loop has work waiting; ``cut_for_loop`` may come from any thread."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        # The window in flight (its step id), until its result is collected.
        self._step_id: int | None = None
        # The last window a CutStep went out for: a window is cut once, though an arrival may come while it is sent.
        self._cut_step_id: int | None = None
        # Set by ``cut_for_loop`` until the loop has taken its work in (``loop_work_taken``): a window in flight is
        # cut, and no step is booked on it or after it before that work is in the scheduler.
        self.loop_work_pending = False

    @staticmethod
    def is_window(is_prefill: bool, record: StepRecord) -> bool:
        return not is_prefill and record.drafts is None and any(count > 1 for count in record.counts)

    def cut_for_loop(self) -> None:
        """The loop has work to do before the next plan: the window in flight stops after its current pass. Once
        per batch of such work: until the loop has taken it in, a window launched is cut as it goes out
        (``sent``), so a burst of arrivals sends one CutStep."""
        if self.loop_work_pending:
            return
        self.loop_work_pending = True
        self.cut()

    def loop_work_taken(self) -> None:
        """What ``cut_for_loop`` announced is in the scheduler: requests queued, cancels applied (the loop thread)."""
        self.loop_work_pending = False

    def cut(self) -> None:
        """Stop the window in flight, if any, after its current pass (advisory: CutStep), unless it was cut already."""
        step_id = self._step_id
        if step_id is not None and step_id != self._cut_step_id:
            self._cut_step_id = step_id
            self._executor.cut(step_id)

    def sending(self, step_id: int) -> None:
        """Window ``step_id`` is about to go out: from here on a cut names it (even while a synchronous executor
        runs it)."""
        self._step_id = step_id

    def sent(self) -> None:
        """The window went out: it is cut at once when loop work came while it was planned."""
        if self.loop_work_pending:
            self.cut()

    def collected(self, step_id: int) -> None:
        """Window ``step_id``'s result is in: there is no window in flight to cut."""
        if self._step_id == step_id:
            self._step_id = None

    def may_book_ahead(self, scheduler: Scheduler) -> bool:
        """Whether the next plan may be booked on the window in flight: not while the loop has work or a request
        waits, since the next step may be its prefill."""
        return not self.loop_work_pending and not scheduler.waiting

    @staticmethod
    def give_back(scheduler: Scheduler, planner: Planner, record: StepRecord, plan: StepPlan) -> None:
        """The window a plan was booked on was cut, so the executor drops that plan: its booking is given back to the
        scheduler (tokens and slots) and the planner (blocks sent), and its drops are sent again with the next."""
        scheduler.unbook(record)
        scheduler.release_again(planner.unbook(plan))
