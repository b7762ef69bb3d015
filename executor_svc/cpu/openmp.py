"""How torch's OpenMP threads wait between parallel ops; only takes effect before torch is imported.

libgomp's default spins a finished thread ~300,000 times before it sleeps: on a CPU shared with other
processes a spinning thread starves its descheduled peer, and a decode step takes many times as long.
Never spinning (``OMP_WAIT_POLICY=PASSIVE``) pays a futex wake-up on every small op instead, a large
share of a decode step. A short spin keeps threads awake through the microseconds between one layer's
ops and asleep between steps.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def set_wait_policy() -> None:
    """Spin ``SPIN_COUNT`` times before sleeping, unless the environment already chose a policy."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
