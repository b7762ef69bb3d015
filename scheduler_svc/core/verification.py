"""Settling a step whose plan carried proposals: each row gets its own number of tokens, and a verified row gives
back what its rejected proposals had reserved.

A verification row of k proposals was booked (``Scheduler.advance``) as computing 1 + k tokens with k + 1 slots for
them. The executor sampled n of them (``StepResult.num_sampled_tokens``, 1 ..= k + 1): n - 1 accepted proposals, then
its own token. The row's computed tokens end before that last one (start + n), the slots past it go, and its block
table is cut to the blocks of its computed tokens, the rest freed at once, as the executor cuts its own. Hashes are
registered only for full blocks of those computed tokens, so never for a rejected proposal. Stop rules apply to the
n tokens as to a multi-step decode's: a stop among them ends the sequence there and drops the rest.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from scheduler_svc.core.step_record import StepRecord, TokenOutput

if TYPE_CHECKING:
    from scheduler_svc.core.scheduler import Scheduler


def check_sampled(record: StepRecord, num_tokens: int, num_sampled: list[int]) -> None:
    """The executor's tokens per row must fit the plan: 1 for a row without proposals, 1 ..= k + 1 for k."""
    if len(num_sampled) != len(record.seqs):
        raise ValueError(f"the executor returned num_sampled_tokens for {len(num_sampled)} requests of a step "
                         f"with proposals that scheduled {len(record.seqs)}")
    for drafts, n in zip(record.drafts, num_sampled, strict=True):
        if not 1 <= n <= drafts + 1:
            raise ValueError(f"the executor sampled {n} tokens for a request that verified {drafts} proposals")
    if sum(num_sampled) != num_tokens:
        raise ValueError(f"the executor returned {num_tokens} tokens where num_sampled_tokens adds up to "
                         f"{sum(num_sampled)}")


def settle_verification(scheduler: Scheduler, record: StepRecord, token_ids: list[int], logprobs: Collection[Any],
                        num_sampled: list[int]) -> list[TokenOutput]:
    """``Scheduler.settle`` for a step with proposals (rows in plan order)."""
    check_sampled(record, len(token_ids), num_sampled)
    block_manager, speculator = scheduler.block_manager, scheduler.speculator
    block_size, revived = scheduler.block_size, block_manager.revived
    logprobs = logprobs if len(logprobs) else None
    settled = []
    offset = 0
    rows = zip(record.seqs, record.starts, record.counts, record.slots, record.drafts, num_sampled, strict=True)
    for seq, start, count, slot, drafts, n in rows:
        first, offset = offset, offset + n
        if drafts:
            if not seq.is_finished:
                seq.verifying = False
                del seq.token_ids[slot + n :]  # the slots of rejected proposals
                if seq.block_table:  # else preempted while in flight: it holds no computed tokens
                    seq.num_cached_tokens = start + n
                count = n
            speculator.verified(seq, drafts, n - 1)
        if seq.is_finished:  # aborted or stopped while its step was in flight
            continue
        computed_end = start + count
        reason = None
        if slot >= 0:
            sampled = token_ids[first:offset]
            kept, reason = seq.stop_rule.check(sampled, slot - seq.num_prompt_tokens, seq.token_ids)
            seq.token_ids[slot : slot + kept] = sampled[:kept]
            end = first + kept
            settled.append(TokenOutput(seq, sampled[:kept], logprobs and logprobs[first:end], slot,
                                       reason is not None))
            computed_end = min(computed_end, slot + kept)
        if seq.block_table and (start // block_size != computed_end // block_size
                                or record.is_prefill and seq.seq_id in revived):
            block_manager.hash_blocks(seq, start, computed_end)
        if reason is not None:
            scheduler.finish(seq, reason)
        elif drafts and seq.block_table:
            block_manager.trim(seq, -(-seq.num_cached_tokens // block_size))
    return settled
