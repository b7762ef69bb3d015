"""``DecodeTables``: a decode step's padded block tables, reused row by row from the step before, are exactly what
padding every table anew gives, through appended blocks, cut tables, requests that come, go and change places, and
a table that grows or shrinks; an array handed out is never written again."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from executor_svc.core.request_table import TABLE_VERSIONS
from executor_svc.runtime.model_input import DecodeTables, pad_block_tables


def state(num_blocks: int, rng: random.Random) -> SimpleNamespace:
    return SimpleNamespace(block_table=[rng.randrange(10_000) for _ in range(num_blocks)],
                           table_version=next(TABLE_VERSIONS))


def changed(s: SimpleNamespace) -> None:
    """What the request table does after each change of a table."""
    s.table_version = next(TABLE_VERSIONS)


def test_reused_tables_are_the_padded_tables_through_every_change():
    rng = random.Random(0)
    tables = DecodeTables()
    states = [state(rng.randint(1, 12), rng) for _ in range(40)]
    handed_out: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(400):
        for s in states:
            roll = rng.random()
            if roll < 0.08:  # a new block
                s.block_table.append(rng.randrange(10_000))
                changed(s)
            elif roll < 0.10 and len(s.block_table) > 1:  # a verification cut its table
                del s.block_table[rng.randint(1, len(s.block_table) - 1):]
                changed(s)
        roll = rng.random()
        if roll < 0.05:
            states.append(state(rng.randint(1, 20), rng))
        elif roll < 0.10 and len(states) > 1:
            states.pop(rng.randrange(len(states)))
        elif roll < 0.13:
            rng.shuffle(states)
        got = tables.pad(states).numpy()
        expected = pad_block_tables([s.block_table for s in states]).numpy()
        np.testing.assert_array_equal(got, expected)
        handed_out.append((got, got.copy()))
    for array, copy in handed_out:
        np.testing.assert_array_equal(array, copy)


def test_a_new_state_never_takes_an_old_ones_rows():
    rng = random.Random(1)
    tables = DecodeTables()
    first = [state(3, rng) for _ in range(4)]
    tables.pad(first)
    second = [SimpleNamespace(block_table=list(s.block_table[::-1]), table_version=next(TABLE_VERSIONS))
              for s in first]
    np.testing.assert_array_equal(tables.pad(second).numpy(),
                                  pad_block_tables([s.block_table for s in second]).numpy())
