"""How often the API process hands a step's outputs to its streams: at once, unless writing them takes it more
than its share of a core, when it holds them back and each stream's next message carries several tokens.

gRPC Python sends each message with a system call of its own and wakes the event loop for each completion, so a
process writing a token a message to hundreds of streams spends most of a core on it (W5 ``api``), CPU taken from
the engine loop and the executor on a small machine, and from the clients. Tokens held back a few milliseconds reach
a reader a step or two later, in one piece; the messages they save are most of what the process spends. At a few
dozen streams (a CPU's serving load) the writing stays far below the share and nothing is held. A request's first
outputs are never held (``api_process.Link``): the pacing costs no first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WritePacer:
    """Says how long to hold the next outputs so that, since they were last handed on, this process has spent at
    most ``share`` of the time on a core (``share`` 1: a core's worth, as fast as one thread writes)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self.share = share
        self._clock, self._cpu = clock, cpu
        self._wall0, self._cpu0 = clock(), cpu()

    def delay(self) -> float:
        """Seconds to hold outputs that are ready now (0: hand them on at once)."""
        spent = self._cpu() - self._cpu0
        return max(0.0, spent / self.share - (self._clock() - self._wall0))

    def handed_on(self) -> None:
        """The held outputs went to their streams: the writing they cause is counted from here."""
        self._wall0, self._cpu0 = self._clock(), self._cpu()
