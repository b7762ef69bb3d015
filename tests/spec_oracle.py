"""A model-free oracle for speculative decoding in the scheduler core: each next token is a function of the whole
context, and the "executor" verifies proposals against it, so a booking or give-back bug changes the tokens."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from scheduler_svc.core.planner import Planner
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import PENDING, Sequence
from tests.conftest import EOS

VOCAB = 40


def next_token(context: list[int], period: int = 3) -> int:
    """Mostly repeats the token ``period`` back (so n-grams recur and proposals are often right), sometimes not."""
    h = xxhash.xxh64_intdigest(bytes(str(context), "ascii"))
    if len(context) > period and h % 4:
        return context[-period]
    return 1 + h % (VOCAB - 1)


def reference(prompt: list[int], max_tokens: int, eos: bool = False) -> list[int]:
    """The completion a correct scheduler produces (EOS ends it only with ``eos``)."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if eos and t == EOS:
            break
    return out


def verify(context: list[int], drafts: list[int]) -> list[int]:
    """The tokens an exact verifier samples: the proposals that match, then its own."""
    out: list[int] = []
    for draft in drafts:
        t = next_token(context + out)
        if t != draft:
            return [*out, t]
        out.append(t)
    return [*out, next_token(context + out)]


def run_step(scheduler: Scheduler, planner: Planner,
             on_schedule: Callable[[list[Sequence], bool], None] | None = None) -> list:
    """Schedule, plan, book, "execute" and settle one step; returns the outputs. ``on_schedule`` sees the step as
    scheduled."""
    seqs, is_prefill = scheduler.schedule()
    if on_schedule is not None:
        on_schedule(seqs, is_prefill)
    if not seqs:
        return []
    plan, ordered = planner.build(seqs, is_prefill, scheduler.drain_released())
    cached = plan.cached_requests
    assert len(cached.draft_token_ids) == sum(cached.num_draft_tokens), "the plan's proposals do not add up"
    drafts_of = {}
    ids = iter(cached.draft_token_ids)
    for seq_id, k in zip(cached.request_ids, cached.num_draft_tokens or [0] * len(cached.request_ids), strict=True):
        drafts_of[seq_id] = [next(ids) for _ in range(k)]
    record = scheduler.advance(ordered, is_prefill)
    token_ids, num_sampled = [], []
    for seq, slot in zip(record.seqs, record.slots, strict=True):
        if slot < 0:
            sampled = [0]
        else:
            context = seq.token_ids[:slot]
            assert PENDING not in context
            sampled = verify(context, drafts_of.get(seq.seq_id, []))
        token_ids += sampled
        num_sampled.append(len(sampled))
    outputs = scheduler.settle(record, token_ids, (), None, num_sampled if record.drafts else None)
    if record.drafts:
        planner.tables_cut([s for s, k in zip(record.seqs, record.drafts, strict=True) if k])
    check_tables(scheduler)
    return outputs


def check_tables(scheduler: Scheduler) -> None:
    """Between steps a decoding sequence holds exactly the blocks of its computed tokens (no rejected slot kept)."""
    bs = scheduler.block_size
    for seq in scheduler.running:
        if seq.block_table and seq.num_cached_tokens == len(seq.token_ids) - 1:
            assert len(seq.block_table) == -(-seq.num_cached_tokens // bs), "a block past the computed tokens"


def run_all(scheduler: Scheduler, planner: Planner | None = None, max_steps: int = 10_000) -> int:
    """Run the queues empty; returns the steps taken."""
    planner = planner or Planner()
    steps = 0
    while not scheduler.is_finished():
        run_step(scheduler, planner)
        steps += 1
        assert steps < max_steps
    return steps
