"""vLLM's pause (``/pause``, ``/resume``), for weight updates and maintenance: while paused, requests that arrive wait
outside the engine (``held``) until the resume; what was in flight is aborted (``abort``), finishes (``wait``), or stops
where it is, its KV blocks kept, until the resume (``keep``). A pause call returns once the engine is idle (at once for
``keep``), the prefix cache dropped first where asked (``clear_cache``); a resume or a ``keep`` before then ends that
wait with ``PauseLifted``. A drain lifts ``keep`` (what runs may finish in its grace period) and refuses the requests
held."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from scheduler_svc.core.errors import STOPPING, ServerStopping
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.live_requests import LiveRequests, RequestHandle
from scheduler_svc.engine.supervision import Supervisor

PauseMode = Literal["abort", "wait", "keep"]


class PauseLifted(Exception):
    """A pause call's wait for an idle engine ended by a resume, or by a pause with ``keep``, before it was idle."""


def settle(done: Future[None], error: Exception | None = None) -> None:
    """Complete a pause call's future, unless its caller gave up on it (cancelled)."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


@dataclass
class Pause:
    """The loop thread's pause state."""

    mode: PauseMode | None = None
    # Requests that arrived while paused, admitted on the resume in their order.
    held: list[RequestHandle] = field(default_factory=list)
    # Pause calls waiting for the engine to be idle, and whether each drops the prefix cache then.
    waiters: list[tuple[Future[None], bool]] = field(default_factory=list)


class Pausing:
    """``EngineLoop``'s pause: the public calls (any thread) and what the loop thread asks of it."""

    engine: Engine
    supervisor: Supervisor
    _requests: LiveRequests
    _drain_deadline: float | None
    # The loop's own (``EngineCalls.call``, ``EngineLoop._admit``, ``EngineLoop._has_work``).
    call: Callable[[Callable[[Engine], object]], Future]
    _admit: Callable[[list[RequestHandle]], None]
    _has_work: Callable[[], bool]

    @cached_property
    def _pause(self) -> Pause:
        return Pause()

    def cancel(self, handle: RequestHandle, answer: bool = False) -> None:
        """Abort ``handle`` before the next step (``answer``: its choices end with ABORT), unless finished; one a
        pause holds never starts."""
        def cancel(engine: Engine) -> None:
            if handle in self._pause.held:
                self._pause.held.remove(handle)
                self._requests.refuse(handle, answer, drained=False)
            else:
                self._requests.cancel(engine, handle, answer)
        self.call(cancel)

    def pause(self, mode: PauseMode, clear_cache: bool) -> Future[None]:
        """Pause; the future completes once the engine is idle (``keep``: once paused)."""
        done: Future[None] = Future()

        def pause(engine: Engine) -> None:
            self._pause.mode = mode
            if mode == "keep":
                self._lift("a pause with keep came first")
                settle(done)
                return
            if mode == "abort":
                self._requests.end_all(engine, drained=False)
            self._pause.waiters.append((done, clear_cache))

        self.call(pause).add_done_callback(lambda call: call.exception() and settle(done, call.exception()))
        return done

    def resume(self) -> Future[None]:
        """The requests held are admitted, in their order, and steps go on."""
        def resume(engine: Engine) -> None:
            self._lift("a resume came first")
            held, self._pause.held, self._pause.mode = self._pause.held, [], None
            self._admit(held)
        return self.call(resume)

    @property
    def paused(self) -> bool:
        return self._pause.mode is not None

    # The loop thread.

    def _take_in(self, handles: list[RequestHandle]) -> None:
        """Admit the requests that arrived, or hold them while paused."""
        if self.paused:
            self._pause.held += handles
        else:
            self._admit(handles)

    def _can_step(self) -> bool:
        """Work to do, and no pause with ``keep`` freezing it (a drain lifts that)."""
        return self._has_work() and (self._pause.mode != "keep" or self._drain_deadline is not None)

    def _lift(self, why: str) -> None:
        waiters, self._pause.waiters = self._pause.waiters, []
        for done, _ in waiters:
            settle(done, PauseLifted(f"the pause was lifted before the engine was idle: {why}"))

    def _settle_pause(self) -> None:
        """The pause calls waiting for an idle engine return once no request is left and nothing is in flight
        (dropped requests' blocks too; while the executor is down, the recovery resets it anyway), the prefix cache
        dropped first where one asked."""
        if not self._pause.waiters or self._requests or (self._has_work() and self.supervisor.serving):
            return
        waiters, self._pause.waiters = self._pause.waiters, []
        if any(clear for _, clear in waiters):
            self.engine.block_manager.flush()
        for done, _ in waiters:
            settle(done)

    def _end_pause(self) -> list[RequestHandle]:
        """Shutting down: the pause calls waiting fail; the requests held, returned, are refused with the rest."""
        held, waiters = self._pause.held, self._pause.waiters
        self._pause.held, self._pause.waiters = [], []
        for done, _ in waiters:
            settle(done, ServerStopping(STOPPING))
        return held
