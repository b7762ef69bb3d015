"""Executor supervision: is the executor serving, when to probe it, when to retry, when to give up.

A plain state machine with the time passed in, so each rule is unit-tested without threads or
sockets (tests/test_supervision.py); the engine loop feeds it what happened and does what it says.

- A failed step, a failed probe or a restarted executor puts it DOWN: health turns NOT_SERVING and
  recovery is tried at once, then with exponential backoff.
- Steps failing ``MAX_FAILED_STEPS`` times with no progress in between (a step that decodes, or begins a request's
  first prefill; recoveries and their recompute prefills are no progress) mean the executor refuses this very work:
  the requests in flight are failed so the rest can carry on. A decode that fails every time would otherwise
  advance each of its sequences a token per executor restart, by the recompute's prefill.
- An executor that came back serving another model is INCOMPATIBLE: requests fail fast until the
  right one is back.
- An idle loop probes every ``IDLE_PROBE_S`` so health turns NOT_SERVING without waiting for a request.
- A resync (a recording starting) recovers once though the executor serves, so the recording begins from an empty
  executor; health stays SERVING.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from scheduler_svc.engine.backoff import Backoff

MAX_FAILED_STEPS = 3
IDLE_PROBE_S = 2.0


class ExecutorState(Enum):
    SERVING = auto()
    DOWN = auto()
    INCOMPATIBLE = auto()


@dataclass
class Supervisor:
    now: float
    backoff: Backoff = field(default_factory=Backoff)
    state: ExecutorState = ExecutorState.SERVING
    # Why requests cannot carry over, while INCOMPATIBLE.
    incompatible: str | None = None
    retry_at: float = 0.0
    probe_at: float = field(init=False)
    failed_steps: int = 0
    # The engine's steps of progress settled, as of the last step that succeeded.
    num_progress_steps: int = 0
    # Recover at the next retry though serving (``resync``).
    resync_due: bool = False

    def __post_init__(self) -> None:
        self.probe_at = self.now + IDLE_PROBE_S

    @property
    def serving(self) -> bool:
        return self.state is ExecutorState.SERVING

    def step_succeeded(self, num_progress_steps: int) -> None:
        """A step settled; ``num_progress_steps``: the engine's ``Scheduler.num_progress_steps``. Only progress (a
        decode, a request's first prefill) clears the count."""
        if num_progress_steps > self.num_progress_steps:
            self.failed_steps = 0
        self.num_progress_steps = num_progress_steps

    def step_failed(self, now: float) -> bool:
        """Go DOWN; True when the work in flight should be failed (the same work failed too often)."""
        self.failed_steps += 1
        give_up = self.failed_steps >= MAX_FAILED_STEPS
        if give_up:
            self.failed_steps = 0
        self.go_down(now)
        return give_up

    def go_down(self, now: float) -> bool:
        """The executor is gone, hung or restarted; True when this turned health NOT_SERVING."""
        was_serving = self.serving
        if was_serving:
            self.state = ExecutorState.DOWN
            self.backoff.reset()
        self.retry_at = now
        return was_serving

    def probe_due(self, now: float) -> bool:
        return self.serving and now >= self.probe_at

    def retry_due(self, now: float) -> bool:
        return (self.resync_due or not self.serving) and now >= self.retry_at

    def resync(self, now: float) -> None:
        """Recover now, though the executor serves: handshake, reset, every request recomputed."""
        self.resync_due, self.retry_at = True, now

    def postpone_probe(self, now: float) -> None:
        """The loop just did something: the executor was heard from (or will be) without a probe."""
        self.probe_at = now + IDLE_PROBE_S

    def recovery_failed(self, now: float) -> float:
        """Still down: the delay until the next attempt."""
        delay = self.backoff.next()
        self.retry_at = now + delay
        return delay

    def recovered_incompatible(self, now: float, reason: str) -> bool:
        """The executor answers but cannot take these requests; True the first time (worth an error log)."""
        first = self.incompatible is None
        self.state, self.incompatible = ExecutorState.INCOMPATIBLE, reason
        self.recovery_failed(now)
        return first

    def recovered(self, now: float) -> None:
        """Back: health SERVING again."""
        self.state, self.incompatible, self.resync_due = ExecutorState.SERVING, None, False
        self.postpone_probe(now)

    def wake_at(self, has_work: bool) -> float | None:
        """When the loop must wake without news: a retry while down, a probe while idle; None: it has work now."""
        if self.resync_due or not self.serving:
            return self.retry_at
        return None if has_work else self.probe_at
