"""The engine loop: one thread owns the Engine; RPCs feed it through ``submit``, ``cancel`` and ``call``.

Each iteration admits requests, runs the calls (cancels free blocks at once), runs one engine step, turns its tokens
into text and hands the outputs to ``deliver`` and the cache's events to ``Engine.kv_events``; idle, it sleeps until
woken or the ``Supervisor`` wants a probe or retry. A failed step or a ``resync`` loses no request: all recompute."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from scheduler_svc.core.errors import EngineFailure, ExecutorUnavailable, InvalidRequest, internal_error
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.engine.admission import Admission, QueueLimits
from scheduler_svc.engine.calls import EngineCalls
from scheduler_svc.engine.engine import Engine, TokenOutput
from scheduler_svc.engine.executor_client import describe_failure
from scheduler_svc.engine.live_requests import LiveRequests, RequestHandle
from scheduler_svc.engine.outages import probe, recover
from scheduler_svc.engine.pause import Pausing
from scheduler_svc.engine.stats import LoopObserver, LoopStats
from scheduler_svc.engine.supervision import Supervisor

log = logging.getLogger("nanoserve.scheduler")

Deliver = Callable[[list[tuple[RequestHandle, RequestOutput]]], None]
OnServing = Callable[[bool], None]
T = TypeVar("T")


class EngineLoop(EngineCalls, Pausing):
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer | None, deliver: Deliver, limits: QueueLimits,
                 observer: LoopObserver, on_serving: OnServing = lambda serving: None) -> None:
        """``on_serving(False)`` when the executor fails, ``(True)`` once back; ``observer`` hears of each step and
        each choice's times (both on the loop thread)."""
        self.engine = engine
        self.info = engine.info
        self.tokenizer = tokenizer
        self.deliver = deliver
        self.on_serving = on_serving
        self.admission = Admission(limits)
        self.supervisor = Supervisor(time.monotonic())
        self._serving_reported = True
        self._wakeup = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._drain_deadline: float | None = None
        self._requests = LiveRequests(self.admission, observer)
        engine.on_step = observer.step
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # Called from any thread.

    def start(self) -> None:
        self._thread.start()

    def submit(self, prepared: PreparedRequest, sink: object, arrived_at: float,
               tokens_per_read: float = 1) -> RequestHandle:
        """Queue a validated request that arrived at ``arrived_at`` (time.monotonic); raise QueueFull, ServerStopping or
        InvalidRequest when it cannot be taken. ``tokens_per_read``: how many of a choice's tokens its reader takes at a
        time (inf: whole completions), the most decode steps a plan computes for it. A window in flight is cut short."""
        self.admission.admit(len(prepared.prompt_token_ids))
        handle = RequestHandle(prepared, sink, arrived_at, tokens_per_read)
        with self._wakeup:
            if self._stopped:  # admitted just before the drain closed admission, too late for the loop to answer it
                self.admission.withdraw(len(prepared.prompt_token_ids))
            self._inbox.append(handle)
            self.engine.cut_for_loop()
            self._wakeup.notify()
        return handle

    def set_reading(self, handles: list[RequestHandle], tokens: float) -> None:
        """The readers of ``handles`` now take ``tokens`` of a choice at a time (the API process's pacing): their plans
        may compute that many decode steps at once, or their own ``tokens_per_read`` where more."""
        self.call(lambda engine: self._requests.set_reading(handles, tokens))

    def resync(self) -> None:
        """Start over on an empty executor, as after a restart (a recording begins from one)."""
        with self._wakeup:
            self.supervisor.resync(time.monotonic())
            self._wakeup.notify()

    def stop(self, grace_s: float = 0.0, join_timeout_s: float | None = None) -> None:
        """Refuse new requests, give those in flight ``grace_s`` seconds, abort the rest; wait for the thread."""
        self.admission.close()
        with self._wakeup:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + grace_s
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(join_timeout_s)

    # The loop thread.

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or self.engine.has_drops_to_send()

    def _run(self) -> None:
        supervisor = self.supervisor
        while True:
            with self._wakeup:
                self._wait()
                inbox, self._inbox = self._inbox, []
                calls = self._take_calls()
                if inbox or calls:
                    self.engine.loop_work_taken()
            try:
                self._take_in(inbox)
                self._run_calls(calls)
                if calls:  # a cancel's answers go now, not after the next step (a window, with requests beside them)
                    self._deliver()
                now = time.monotonic()
                if supervisor.retry_due(now):
                    recover(self.engine, self._requests, supervisor)
                    self.info = self.engine.info
                elif supervisor.serving and self._can_step():
                    self._step()
                elif supervisor.probe_due(now):
                    probe(self.engine, supervisor)
            except Exception as e:  # a bug in the loop: answer every caller, then start over on a reset executor
                log.exception("engine loop failed: %s", e)
                self._requests.end_all(self.engine, internal_error(e))
                supervisor.go_down(time.monotonic())
            if supervisor.serving != self._serving_reported:
                self._serving_reported = supervisor.serving
                self.on_serving(supervisor.serving)
            if self._drained():
                self._shutdown()
                return
            self._settle_pause()
            self._publish()

    def _wait(self) -> None:
        """Sleep (lock held) until there is work: requests, calls, a step, a retry, a probe, the drain's end."""
        while not (self._inbox or self._calls):
            wake_at = self.supervisor.wake_at(self._can_step())
            if wake_at is None:
                return
            if self._drain_deadline is not None:
                if not self._requests:
                    return
                wake_at = min(wake_at, self._drain_deadline)
            timeout = wake_at - time.monotonic()
            if timeout <= 0:
                return
            self._wakeup.wait(timeout)

    def _drained(self) -> bool:
        """Stopping, and either nothing is left in flight or the grace period is over."""
        with self._wakeup:
            deadline = self._drain_deadline
            return deadline is not None and (time.monotonic() >= deadline or not (self._requests or self._inbox))

    def _admit(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            try:
                if self.supervisor.incompatible is not None:
                    raise ExecutorUnavailable(self.supervisor.incompatible)
                self._requests.start(self.engine, handle, 0, self.tokenizer)
            except (ExecutorUnavailable, InvalidRequest) as e:  # InvalidRequest: the cache shrank since the check
                self._requests.emit(handle, RequestOutput(error=e))
        if handles:  # whoever reads an output of theirs must not read the stats from before they came (idle)
            self._refresh_stats()

    def _step(self) -> None:
        """Engine steps: one, then, once every request finished, what is left for the executor (idle means empty).
        When the step's outputs cannot change the next plan and nothing waits for the loop, the next plan (with
        overlap, the one after the plan in flight) goes out before they are processed, and the loop collects it
        before it takes other work."""
        while (outputs := self._executor_step()) is not None:
            ahead = self._launch_ahead(outputs)
            self._requests.process(self.engine, outputs, self.tokenizer)
            if ahead is None:  # the launch failed: the loop waits for the executor
                return
            if ahead:
                self._publish()
                continue
            if not (self._has_work() and self.engine.nothing_to_schedule()):
                return
            self._deliver()  # what is left changes no output: at most the step in flight, then the drops

    def _launch_ahead(self, outputs: list[TokenOutput]) -> bool | None:
        """``Engine.launch_ahead`` unless requests, calls, a resync or a drain wait (they go first) or the outputs may
        change the next plan (a stop string ends a sequence, a request's other choices start); None if the executor
        failed. Without overlap (a CPU executor) a request's first token leaves first, a resumed request's first new
        one too: the next forward would hold the cores its way to the client needs (W3's time to first token)."""
        if self._inbox or self._calls or self.supervisor.resync_due or self._drain_deadline is not None:
            return False
        if not self.engine.overlap and self._requests.brings_a_first_token(outputs):
            return False
        return self._requests.outputs_leave_plans_alone and self._executor_call(self.engine.launch_ahead)

    def _executor_step(self) -> list[TokenOutput] | None:
        """``Engine.step``; None when the executor failed it (the loop then waits for the executor)."""
        outputs = self._executor_call(self.engine.step)
        if outputs is not None:
            self.supervisor.step_succeeded(self.engine.scheduler.num_progress_steps)
        return outputs

    def _executor_call(self, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except Exception as e:  # gone, restarted, past --step-timeout, or it refused the plan
            reason = describe_failure(e)
            log.warning("executor step failed (%s); %d requests wait for it to come back", reason, len(self._requests))
            if self.supervisor.step_failed(time.monotonic()):
                log.error("the executor failed the same work repeatedly; failing the requests in flight")
                self._requests.end_all(self.engine, EngineFailure(f"the executor keeps failing this work ({reason}); "
                                                                   "retry the request"))
            return None

    def _shutdown(self) -> None:
        """The grace period is over: abort what is left, tell the executor to drop it, answer each caller."""
        with self._wakeup:
            leftover, self._inbox, self._stopped = self._inbox + self._end_pause(), [], True
            self._fail_calls()
        for handle in leftover:
            self._requests.refuse(handle)
        num_aborted = len(leftover) + self._requests.end_all(self.engine)
        if num_aborted:
            log.warning("shutdown grace period over: %d requests aborted", num_aborted)
        try:
            # Under overlap the first step collects the one in flight and the second drops what it finished.
            while self.supervisor.serving and self._has_work():
                self.engine.step()
        except Exception as e:  # shutting down anyway; the executor is reset on the next start
            log.warning("could not tell the executor to drop aborted requests: %s", describe_failure(e))
        self._publish()

    def _deliver(self) -> None:
        """The outputs waiting. In the middle of an iteration they leave with the stats as they were, still counting
        the requests the executor holds (idle stats mean an empty executor); ``_publish`` refreshes them first."""
        if outbox := self._requests.take_outbox():
            self.deliver(outbox)

    def _publish(self) -> None:
        """End of an iteration: refresh the stats, deliver the outputs and the KV events, postpone the probe."""
        self._refresh_stats()
        self._deliver()
        self.engine.kv_events.collect(self.engine.block_manager, self.engine.adapters.name_of)
        self.supervisor.postpone_probe(time.monotonic())

    def _refresh_stats(self) -> None:
        self.stats = LoopStats.of(self.engine, self._requests, self.supervisor.serving, len(self._pause.held))
