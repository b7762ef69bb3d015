"""Exponential backoff for reconnecting to the executor, at start-up and after a failure."""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_RETRY_S = 0.1
MAX_RETRY_S = 5.0


@dataclass
class Backoff:
    """Delays of 0.1 s doubling to 5 s: quick when the executor is only restarting, quiet when it is gone."""

    first_s: float = FIRST_RETRY_S
    max_s: float = MAX_RETRY_S
    delay_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay_s = self.first_s

    def next(self) -> float:
        """The delay before the next attempt; each call doubles the one after, up to ``max_s``."""
        delay, self.delay_s = self.delay_s, min(2 * self.delay_s, self.max_s)
        return delay

    def reset(self) -> None:
        self.delay_s = self.first_s
