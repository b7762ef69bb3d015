"""How often the API process hands a step's outputs to its streams: at once, unless writing them takes it more
than its share of a core, when it holds them back and each stream's next message carries several tokens.

gRPC Python sends each message with a system call of its own and wakes the event loop for each completion, so a
process writing a token a message to hundreds of streams spends most of a core on it (W5 ``api``), CPU taken from
the engine loop and the executor on a small machine, and from the clients. Tokens held back a few milliseconds reach
a reader a step or two later, in one piece; the messages they save are most of what the process spends. At a few
dozen streams (a CPU's serving load) the writing stays far below the share and nothing is held. A request's first
outputs are never held (``api_process.Link``): the pacing costs no first token.

The share is of one core, and by default a tenth of the machine's cores (``default_share``): what this process
spends is taken from the engine loop and the executor only where the cores are few, and there fewer, larger messages
keep an accelerator busier (W5 ``api``, docs/benchmarks-history.md); on ten cores or more nothing is held that one
thread can write. While it holds, the scheduler is told what each stream takes at a time (``PacedReading``), and
plans that many decode steps at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

MACHINE_SHARE = 0.1


def usable_cores(cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores this process may run on: its CPU affinity, or its cgroup's CPU quota (cgroup v2 ``cpu.max``, as a
    container's CPU limit sets it) where that is less."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        path = next(line[3:].strip() for line in cgroup.read_text().splitlines() if line.startswith("0::"))
        quota, period = (cgroup_root / path.lstrip("/") / "cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, int(quota) / int(period))
    return cores


def default_share(cores: float) -> float:
    """``--api-process-cpu-share`` when none is given: a tenth of ``cores``, at most one core."""
    return min(1.0, MACHINE_SHARE * cores)


def share_of(flag: float | None) -> float:
    """The share the API process is paced by: the flag's, else this machine's default."""
    return default_share(usable_cores()) if flag is None else flag


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


class PacedReading:
    """How many tokens each stream takes at a time while the pacer holds outputs back, for the scheduler: a plan may
    then compute that many decode steps at once (a multi-step window) and no reader gets a token later than the pacing
    would hand it on anyway, while the engine loop plans, settles and sends a step's outputs once a window instead of
    once a step. A power of two, lowered only when a hand-over carries under half of it (a window's length changes
    seldom); back to 1 once outputs have gone at once for ``settle_s``."""

    def __init__(self, settle_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.value = 1
        self._settle_s, self._clock = settle_s, clock
        self._held_at = -math.inf

    def handed_on(self, held: bool, tokens: int, streams: int) -> int | None:
        """A hand-over of ``tokens`` to ``streams`` streams, ``held`` back by the pacer or not: the new reading when
        it changed, else None."""
        now = self._clock()
        if held and streams:
            self._held_at = now
            each = max(1, tokens // streams)
            if self.value // 2 <= each < 2 * self.value:
                return None
            value = 1 << (each.bit_length() - 1)
        elif now - self._held_at >= self._settle_s:
            value = 1
        else:
            return None
        if value == self.value:
            return None
        self.value = value
        return value
