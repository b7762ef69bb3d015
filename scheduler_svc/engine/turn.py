"""The engine's turn: from a step's result to the next plan on its way, the event loop gives way.

The scheduler's engine loop and the event loop that writes every stream share one GIL. Once a step's result is back,
the path to the next plan (the result handed from the stream's reader to the engine loop, settle, outputs, schedule,
the plan handed to gRPC's sending thread) is what the accelerator waits for, and every hand-over on it waited behind
the event loop's writing of the step before, half a switch interval at a time (W5 ``api``). So the executor's stream
takes the turn as a result arrives and ends it as gRPC takes the next plan, and the event loop blocks, its GIL
released, whenever it finds the turn taken, until the turn ends or ``MAX_WAIT_S`` after it began (a turn no plan
follows, the last step's, ends so), and after each wait it has as long again to itself. Both bounds keep the event
loop going when it is saturated: gRPC takes in one new call per round of the loop, and with longer waits, at short
steps and many streams, some requests were only admitted once others had finished (W5 ``api``). Writing the streams
only comes a little later; when it falls behind, a stream's next response carries every token since its last
(``Outbox``).
"""

from __future__ import annotations

import threading
import time

# The longest the event loop gives way to one turn: the start of it, where a result waited longest for the engine
# loop to have the GIL (W5 api).
MAX_WAIT_S = 0.001


class Turn:
    """Taken and ended by the executor stream's threads, given way to by the event loop's thread."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._ended = threading.Condition(threading.Lock())
        self._taken = False
        # When the turn taken stops holding the event loop back, and until when the event loop has its own time after
        # its last wait (time.monotonic).
        self._until = 0.0
        self._own_until = 0.0

    def take(self) -> None:
        """A step's result arrived: the engine's turn starts (a turn already taken goes on)."""
        with self._ended:
            if not self._taken:
                self._taken = True
                self._until = time.monotonic() + self._max_wait_s

    def end(self) -> None:
        """The next plan is on its way."""
        with self._ended:
            if self._taken:
                self._taken = False
                self._ended.notify_all()

    def give_way(self) -> None:
        """Wait while the turn is taken, up to its time, unless the event loop's own time after its last wait is not
        over (event loop thread). The first test reads without the lock: a turn missed by a moment is given way to at
        the next call."""
        if not self._taken:
            return
        start = time.monotonic()
        if start < self._own_until:
            return
        with self._ended:
            left = self._until - start
            if left > 0:
                self._ended.wait_for(lambda: not self._taken, left)
                end = time.monotonic()
                self._own_until = end + (end - start)
