"""What a step books between ``Scheduler.advance`` and ``Scheduler.settle``, and the views of it settle takes."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from scheduler_svc.core.sequence import Sequence


@dataclass(slots=True)
class TokenOutput:
    """The completion tokens a step produced for ``seq`` (several under multi-step decode), the first at
    ``position`` in its token ids, with the executor's logprobs of each when it sent them; ``final`` when
    the last of them ended the sequence."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[Any] | None
    position: int
    final: bool


@dataclass(slots=True)
class StepRecord:
    """A step booked by ``advance``, waiting for its tokens in ``settle``: per sequence, the first
    token it computes, how many, and where its first sampled token goes (-1: dropped, an unfinished
    chunk). A decode sequence samples one token per computed token (more than one in multi-step), or, verifying k
    proposals, computes k + 1 and samples 1 ..= k + 1.
    Rows are in the plan's order; ``first`` is the row scheduled first (a prefill's continued chunk, which
    the plan lists after its new requests)."""

    seqs: list[Sequence]
    starts: list[int]
    counts: list[int]
    slots: list[int]
    is_prefill: bool
    first: int = 0
    # Per row, the proposals it verifies (``core.verification``); None for a step without any.
    drafts: list[int] | None = None
    # It decodes a sequence or begins one's first prefill (``Scheduler.num_progress_steps``).
    progress: bool = False


def in_schedule_order(record: StepRecord, token_ids: list[int],
                      logprobs: Collection[Any]) -> tuple[StepRecord, list[int], Collection[Any]]:
    """A prefill's rows (one token each) with the one scheduled first moved to the front, so that settling
    registers and frees blocks in the order nano-vLLM's postprocess does, and the prefix cache follows its."""
    f = record.first

    def front(rows: Any) -> list[Any]:
        return [rows[f], *rows[:f], *rows[f + 1 :]]

    moved = StepRecord(front(record.seqs), front(record.starts), front(record.counts), front(record.slots), True)
    return moved, front(token_ids), front(logprobs) if len(logprobs) else logprobs


def shorten(record: StepRecord, num_passes: int) -> StepRecord:
    """A multi-step decode that ran only ``num_passes`` steps: each sequence books that many tokens at most, and
    the slots and computed tokens of the steps that did not run are given back. Its blocks stay: the next steps
    write there. A step booked after it was given back first (``Scheduler.unbook``); a sequence preempted meanwhile
    holds no computed tokens, only its slots."""
    if record.is_prefill or num_passes < 1:
        raise ValueError(f"the executor cut a step to {num_passes} passes; only a decode of >= 1 passes is cut")
    counts = []
    for seq, count, slot in zip(record.seqs, record.counts, record.slots, strict=True):
        if count > num_passes:
            if not seq.is_finished:
                if seq.block_table:
                    seq.num_cached_tokens -= count - num_passes
                del seq.token_ids[slot + num_passes :]
                seq.final_token_pending = False
            count = num_passes
        counts.append(count)
    return StepRecord(record.seqs, record.starts, counts, record.slots, record.is_prefill)
