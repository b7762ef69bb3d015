"""Helper threads that give way to a forward pass computing on the CPU (Linux's SCHED_IDLE class).

A CPU model executor's OpenMP team holds every core it was given. Each time a helper thread wakes on one of them
(gRPC's pollers, a step stream's reader and writer, the scheduler's engine loop and event loop), it preempts a team
thread, and the rest of the team waits for that one at its next barrier, many times a decode step (W1). A thread in
SCHED_IDLE runs only on a core that no normal thread wants, so the helpers run on what the team leaves (its barriers,
the Python between kernels, the wait for the next plan) and never preempt it, and W1's split gains throughput. Both
services must yield: either one alone gave nothing. The price is paid at a request's arrival, which now waits for such
a moment too: a later first token (W3). So it is asked for (``--yield-cpu on``), not the default. The figures are in
docs/benchmarks-history.md.

Only processes of one CPU group (cgroup) compete this way: a scheduler in another container than its executor's
yields only to its own threads. A thread put in SCHED_IDLE cannot go back without CAP_SYS_NICE, and threads it
starts are idle too. ``give_way`` is the milder form for the public API's process beside an accelerator (SCHED_BATCH).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger("nanoserve.cpu_yield")


def thread_ids() -> set[int]:
    """Every thread of this process, by kernel thread id (none where there is no /proc)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except FileNotFoundError:
        return set()


def yield_cpu(tids: Iterable[int]) -> int:
    """Put these threads in SCHED_IDLE; how many were (0 where the system has no SCHED_IDLE)."""
    if not hasattr(os, "SCHED_IDLE"):
        log.info("no SCHED_IDLE here: helper threads keep their priority")
        return 0
    return _set_policy(tids, os.SCHED_IDLE)


def give_way(tids: Iterable[int]) -> int:
    """Put these threads in SCHED_BATCH: they keep their share of the CPU but never preempt another thread when they
    wake, so a thread an accelerator waits for (the scheduler's engine loop) has a shared core first; how many were.
    For the public API's process beside an accelerator (W5 ``api``: nice 10 gave the engine loop more, but at 2 ms
    steps the streams it slowed then starved new calls for seconds; SCHED_BATCH never did)."""
    if not hasattr(os, "SCHED_BATCH"):
        return 0
    return _set_policy(tids, os.SCHED_BATCH)


def _set_policy(tids: Iterable[int], policy: int) -> int:
    done = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return done
