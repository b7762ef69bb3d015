"""Work for the engine that is not a request (a cancel, a cache flush, a LoRA adapter's load or unload): queued from
any thread, run by the engine loop's thread between steps, as everything that touches the engine is."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import cached_property
from typing import TypeVar

from scheduler_svc.core.errors import STOPPING, ServerStopping
from scheduler_svc.engine.engine import Engine

T = TypeVar("T")
EngineCall = tuple[Callable[[Engine], object], Future]


class EngineCalls:
    """``EngineLoop``'s calls; every access is under its ``_wakeup`` lock."""

    engine: Engine
    _wakeup: threading.Condition
    # Set (under the lock) once the loop has ended: nothing would run a call made after.
    _stopped: bool = False

    @cached_property
    def _calls(self) -> list[EngineCall]:
        return []

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between steps; its result or error comes in the future."""
        future: Future[T] = Future()
        with self._wakeup:
            if self._stopped:
                future.set_exception(ServerStopping(STOPPING))
                return future
            self._calls.append((fn, future))
            self.engine.cut_for_loop()
            self._wakeup.notify()
        return future

    def _take_calls(self) -> list[EngineCall]:
        calls, self._calls = self._calls, []
        return calls

    def _fail_calls(self) -> None:
        """Shutting down (lock held): the calls no iteration will run fail, so that no caller waits for them."""
        for _, future in self._take_calls():
            if not future.done():
                future.set_exception(ServerStopping(STOPPING))

    def _run_calls(self, calls: list[EngineCall]) -> None:
        """Each call's error goes to its caller, not into the loop."""
        for fn, future in calls:
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)
