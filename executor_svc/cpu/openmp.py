"""How torch's OpenMP threads wait between parallel ops; only takes effect before torch is imported.

libgomp's default spins a finished thread ~300,000 times before it sleeps: on a CPU shared with other
processes a spinning thread starves its descheduled peer, and a decode step takes many times as long.
Never spinning (``OMP_WAIT_POLICY=PASSIVE``) pays a futex wake-up on every small op instead, a large
share of a decode step. A short spin keeps threads awake through the microseconds between one layer's
ops and asleep between steps. On a Xeon with AMX a longer one, awake through the step's Python work too
(about 2 ms there, as vLLM's CPU build spins 5 ms), served W3 with lower latencies and W1 a few percent
faster, in alternating rounds; on the EPYC W1 ran the same at either (docs/benchmarks-history.md).
"""

from __future__ import annotations

import os

from executor_svc.cpu.cpuinfo import cpu_flags

SPIN_COUNT = "10000"
# Where alternating rounds measured the longer spin faster: CPUs with AMX.
LONG_SPIN_COUNT = "200000"


def spin_count() -> str:
    """This CPU's default spin: ``LONG_SPIN_COUNT`` with AMX, else ``SPIN_COUNT``."""
    return LONG_SPIN_COUNT if "amx_bf16" in cpu_flags() else SPIN_COUNT


def set_wait_policy() -> None:
    """Spin ``spin_count()`` times before sleeping, unless the environment already chose a policy."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", spin_count())
