"""nano-vLLM's scheduler: prefill-first continuous batching with preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import Any

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request_order import enqueue, priority_key
from scheduler_svc.core.scheduler_config import POLICY_NAMES as POLICY_NAMES
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import PENDING, FinishReason, Sequence, SequenceStatus, max_kv_blocks
from scheduler_svc.core.speculation import Speculator
from scheduler_svc.core.step_record import StepRecord, TokenOutput, in_schedule_order, shorten
from scheduler_svc.core.stop_rules import StopRule
from scheduler_svc.core.verification import settle_verification


class Scheduler:
    """Decides which sequences run each step and how many tokens each computes.

    Prefill comes first, FIFO from the head of ``waiting``; only the first sequence of a batch may be chunked, and a
    chunked sequence stays at the head until its prompt is computed. Decode runs only when no prefill was scheduled;
    when a block cannot be appended, the tail of ``running`` is preempted (its blocks freed, recomputed later). Both
    queues keep arrival order, or priority order (``core.request_order``). Admission and the token budget count the
    prefix hits nano-vLLM's cache finds, so the schedule is its own; the other copies ours keeps only make a sequence
    compute fewer tokens (``BlockManager``). A decode step computes up to ``num_scheduler_steps`` tokens per sequence,
    never more than the ``max_decode_steps`` of any sequence in it, nor past a sequence's max_tokens or the model's
    length. With speculation, a decode row may verify proposed tokens instead (``core.speculation``,
    ``core.verification``).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_scheduler_steps = config.num_scheduler_steps
        self.max_loras = config.max_loras
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.by_priority = config.request_order == "priority"
        # Ids of sequences whose blocks were freed since the last drain, so the
        # executor can drop their state (finished, aborted or preempted).
        self.released_seq_ids: list[int] = []
        self.num_preemptions = 0
        # Tokens looked up in the prefix cache at each sequence's first allocation (vLLM's prefix-cache queries), and
        # those found; a preempted or requeued sequence's recompute is left out, as vLLM leaves out preempted ones.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        # The sequence the last prefill scheduled first: ``advance`` finds it in the plan's order.
        self._prefill_head: Sequence | None = None
        self.speculator = Speculator(config) if config.speculative else None
        # Steps settled that decoded a sequence or began one's first prefill (a recovery's recompute is neither): the
        # engine loop's sign that the executor gets past the work it failed (``Supervisor.step_succeeded``).
        self.num_progress_steps, self._progress = 0, False

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; refuse one that could never fit in the whole cache."""
        blocks_needed = max(seq.num_blocks, max_kv_blocks(seq.num_prompt_tokens, seq.params.max_tokens,
                                                          self.max_model_len, self.block_size))
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"sequence needs {blocks_needed} KV blocks at its longest but the cache has "
                             f"{self.block_manager.num_blocks}; shorten the prompt or max_tokens")
        seq.stop_rule = StopRule.of(seq.params, seq.num_prompt_tokens, self.eos_token_ids, self.max_model_len)
        if self.speculator is not None:
            self.speculator.attach(seq)
        enqueue(self.waiting, seq, self.by_priority)

    def schedule(self, propose: bool = True) -> tuple[list[Sequence], bool]:
        """Return this step's sequences and whether the step is a prefill; with speculation, ``propose`` False
        (a plan booked on a window in flight) proposes nothing."""
        self._progress = False
        scheduled = self._schedule_prefills([], self.max_num_batched_tokens, self.max_num_seqs)
        if scheduled:
            self._prefill_head = scheduled[0]
            return scheduled, True
        return self._schedule_decodes(self.num_scheduler_steps, self.max_num_seqs, propose=propose), False

    def _schedule_prefills(self, scheduled: list[Sequence], token_budget: int, seq_budget: int) -> list[Sequence]:
        """Prefill FIFO from the head of ``waiting`` into ``scheduled`` within the budgets; only the first prefill
        may be chunked, and a chunked sequence stays at the head until its prompt is computed."""
        num_batched_tokens = 0
        first = len(scheduled)
        adapters = None  # the step's adapters, counted at the first waiting sequence that has one
        while self.waiting and len(scheduled) < seq_budget:
            seq = self.waiting[0]
            remaining = token_budget - num_batched_tokens
            # Below zero when the mixed policy's verification rows (1 + k tokens each) took more than the budget;
            # PENDING: preempted while a step in flight still owes it.
            if remaining <= 0 or seq.token_ids[-1] == PENDING:
                break
            if seq.lora_id and self.max_loras is not None and not seq.block_table:
                adapters = self._adapters_running(scheduled) if adapters is None else adapters
                if seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                    break  # it waits at the head until an adapter's sequences finish (in arrival order: never starves)
                adapters.add(seq.lora_id)
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and len(scheduled) > first:
                break
            # The budget is charged as nano-vLLM counts, so the schedule is its own; a prompt computed whole may
            # compute fewer tokens (``BlockManager``: copies only this cache finds).
            charge = min(num_tokens, remaining)
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks, revive=charge == num_tokens)
                if seq.num_prefix_hit_tokens is None:  # first lookup: as vLLM, a recompute's is not counted
                    self._progress = True
                    self.num_prefix_query_tokens += seq.num_tokens
                    self.num_prefix_hit_tokens += seq.num_cached_tokens
                    seq.num_prefix_hit_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)  # resumed may hit
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens if charge == num_tokens else charge
            num_batched_tokens += charge
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                enqueue(self.running, seq, self.by_priority)
            scheduled.append(seq)
        return scheduled

    def _adapters_running(self, scheduled: list[Sequence]) -> set[int]:
        """The adapters of the running sequences and of those scheduled so far: every one runs in the next decode
        step, so admitting a sequence keeps a step within ``max_loras`` unless its adapter is among them."""
        return {seq.lora_id for seq in (*self.running, *scheduled) if seq.lora_id}

    def _schedule_decodes(self, num_steps: int, seq_budget: int, prefill_may_follow: bool = False,
                          propose: bool = True, proposal_budget: int | None = None) -> list[Sequence]:
        """Decode the running sequences, ``num_steps`` tokens each at most; when a block cannot be appended, the
        tail of ``running`` is preempted (or the sequence itself, when alone). Nothing to decode and nothing held is
        an error unless a prefill may follow in the same step (the mixed policy). Proposals fit in
        ``proposal_budget`` tokens with the decodes (default: the step's token budget)."""
        scheduled: list[Sequence] = []
        # The decode loop runs once per running sequence every step, so whether a sequence needs a
        # block is checked inline: most steps its table already holds the KV it writes, and only one
        # that needs more calls into the block manager (which counts, takes, or says none are free).
        block_manager, block_size, running = self.block_manager, self.block_size, self.running
        max_model_len = self.max_model_len
        hold_in_flight = proposed = False
        if self.speculator is not None and running:
            budget = self.max_num_batched_tokens if proposal_budget is None else proposal_budget
            hold_in_flight, proposed = self.speculator.propose(running, seq_budget, budget, propose)
            if proposed:  # a plan with proposals is one decode step
                num_steps = 1
        if num_steps > 1 and running:  # one step for all: a sequence that stopped earlier would wait for the rest
            num_steps = min(num_steps, min(seq.max_decode_steps for seq in running))
        held: list[Sequence] = []
        steps = 1
        while running and len(scheduled) < seq_budget:
            seq = running.popleft()
            if seq.final_token_pending or seq.verifying or hold_in_flight and seq.token_ids[-1] == PENDING:
                held.append(seq)
                continue
            num_tokens = len(seq.token_ids)
            if seq.num_draft_tokens:  # its own token's block now, its proposals' once every row has its own (below)
                needs_blocks = len(seq.block_table) * block_size < num_tokens
            elif num_steps > 1:
                left = seq.params.max_tokens - (num_tokens - seq.num_prompt_tokens)
                steps = min(num_steps, left, max_model_len - num_tokens)
                # KV is written for positions num_tokens - 1 .. num_tokens + steps - 2.
                needs_blocks = len(seq.block_table) * block_size < num_tokens + steps - 1
            else:
                # The table holds the KV before position num_tokens - 1: it grows when that starts a block.
                needs_blocks = (num_tokens - 1) % block_size == 0
            while needs_blocks and not block_manager.append_blocks(seq, num_tokens + steps - 1):
                if running:
                    self.preempt(running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = steps
                scheduled.append(seq)
        if proposed:
            for seq in scheduled:
                if seq.num_draft_tokens:
                    self._reserve_drafts(seq)
                    seq.num_scheduled_tokens = 1 + seq.num_draft_tokens
        # Nothing fits, unless a sequence waits that was preempted while a step in flight (plans sent ahead) owes it a
        # token: then nothing is scheduled until that step is collected.
        if not scheduled and not held and not prefill_may_follow and not any(
                seq.token_ids[-1] == PENDING for seq in self.waiting):
            raise RuntimeError("nothing can be scheduled: a sequence needs more KV blocks than exist")
        if self.by_priority:  # back ahead of the rest in their places: a held one may precede a scheduled one
            running.extendleft(reversed(sorted([*scheduled, *held], key=priority_key)))
        else:
            running.extendleft(reversed(held))
            running.extendleft(reversed(scheduled))
        self._progress = bool(scheduled)  # a prefill scheduled after the decodes may set it too
        return scheduled

    def _reserve_drafts(self, seq: Sequence) -> None:
        """Take the blocks for ``seq``'s proposals' KV, as many of them as the free blocks hold once every scheduled
        row has the blocks of its own tokens: a proposal never preempts a sequence (its token may well be rejected)."""
        block_manager, num_tokens = self.block_manager, len(seq.token_ids)
        room = (len(seq.block_table) + block_manager.num_free_blocks) * self.block_size - num_tokens
        drafts = seq.num_draft_tokens = max(0, min(seq.num_draft_tokens, room))
        del seq.draft_token_ids[drafts:]
        if drafts:
            block_manager.append_blocks(seq, num_tokens + drafts)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_draft_tokens, seq.draft_token_ids = 0, []
        self._release(seq)
        enqueue(self.waiting, seq, self.by_priority, front=True)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Apply the sampled tokens; return the sequences that gained a token."""
        return [out.seq for out in self.settle(self.advance(seqs, is_prefill), token_ids)]

    def advance(self, seqs: list[Sequence], is_prefill: bool) -> StepRecord:
        """Book a scheduled step as computed, before its tokens are known.

        Its tokens count as cached, and each sequence that keeps this step's tokens (all but an
        unfinished prefill chunk) gets a PENDING slot for each, so the next step can be scheduled
        while this one runs. ``settle`` fills the slots.
        """
        starts, counts, slots = [], [], []
        drafts = [] if self.speculator is not None else None
        for seq in seqs:
            start, count = seq.num_cached_tokens, seq.num_scheduled_tokens
            seq.num_cached_tokens = start + count
            seq.num_scheduled_tokens = 0
            tokens = seq.token_ids
            slot = -1
            if drafts is not None:
                drafts.append(seq.num_draft_tokens)
            if seq.num_draft_tokens:  # verifying: held until its result says how many of the slots it keeps
                slot = len(tokens)
                tokens.extend([PENDING] * count)
                seq.verifying = True
                seq.num_draft_tokens = 0
                seq.draft_token_ids = []
            elif not is_prefill or start + count == len(tokens):
                slot = len(tokens)
                if is_prefill or count == 1:
                    tokens.append(PENDING)
                    last = slot + 1
                else:
                    tokens.extend([PENDING] * count)
                    last = slot + count
                if seq.stop_rule.ends_by_length(last - seq.num_prompt_tokens):
                    seq.final_token_pending = True
            starts.append(start)
            counts.append(count)
            slots.append(slot)
        # The plan lists a prefill's continued chunk, scheduled first, after its new requests.
        first = len(seqs) - 1 if is_prefill and len(seqs) > 1 and seqs[-1] is self._prefill_head else 0
        return StepRecord(seqs, starts, counts, slots, is_prefill, first, drafts if drafts and any(drafts) else None,
                          self._progress)

    def settle(self, record: StepRecord, token_ids: list[int], logprobs: Collection[Any] = (),
               num_passes: int | None = None, num_sampled: list[int] | None = None) -> list[TokenOutput]:
        """Put a step's tokens in place; return what each sequence gained. ``logprobs``, when the
        executor sent them, are parallel to ``token_ids`` and passed through; ``num_passes``, when the
        executor cut a multi-step decode short, is how many decode steps of it ran; ``num_sampled``, for a step
        with proposals, how many tokens each row sampled (``core.verification``).

        This runs for every scheduled sequence every step, so the per-sequence work is inlined:
        blocks are hashed only when the step filled one (their tokens are all known by now) or a
        prefill revived copies to name, and a sequence finishes on EOS, a stop token or its length
        limit; tokens a multi-step decode sampled past that are dropped. Sequences settle in the
        order they were scheduled, as nano-vLLM's postprocess takes them, which the prefix cache's
        names and the free list's order follow.
        """
        self.num_progress_steps += record.progress
        if record.drafts is not None:
            return settle_verification(self, record, token_ids, logprobs, num_sampled or [])
        if num_passes is not None:
            record = shorten(record, num_passes)
        if record.first:
            record, token_ids, logprobs = in_schedule_order(record, token_ids, logprobs)
        settled = []
        block_size, hash_blocks = self.block_size, self.block_manager.hash_blocks
        is_prefill, revived = record.is_prefill, self.block_manager.revived
        expected = len(record.seqs) if record.is_prefill else sum(record.counts)
        one_each = expected == len(record.seqs)  # a prefill, or a decode of one step per sequence
        if len(token_ids) != expected:
            raise ValueError(f"the executor returned {len(token_ids)} tokens for a step that samples {expected}")
        logprobs = logprobs if len(logprobs) else None
        offset = 0  # of this sequence's first token in token_ids, in a multi-step decode
        rows = zip(record.seqs, record.starts, record.counts, record.slots, strict=True)
        for i, (seq, start, count, slot) in enumerate(rows):
            if not one_each:
                first, offset = offset, offset + count
            if seq.is_finished:  # aborted or stopped while its step was in flight
                continue
            computed_end = start + count
            reason = None
            if slot >= 0:
                if one_each:
                    token_id = token_ids[i]
                    seq.token_ids[slot] = token_id
                    reason = seq.stop_rule.check((token_id,), slot - seq.num_prompt_tokens, seq.token_ids)[1]
                    settled.append(TokenOutput(seq, [token_id], logprobs and [logprobs[i]], slot,
                                               reason is not None))
                else:
                    sampled = token_ids[first:offset]
                    kept, reason = seq.stop_rule.check(sampled, slot - seq.num_prompt_tokens, seq.token_ids)
                    seq.token_ids[slot : slot + kept] = sampled[:kept]
                    end = first + kept
                    settled.append(TokenOutput(seq, token_ids[first:end], logprobs and logprobs[first:end],
                                               slot, reason is not None))
                    # KV past the last kept token belongs to dropped tokens.
                    computed_end = min(computed_end, slot + kept)
            if seq.block_table and (start // block_size != computed_end // block_size
                                    or is_prefill and seq.seq_id in revived):
                hash_blocks(seq, start, computed_end)
            if reason is not None:
                self.finish(seq, reason)
        return settled

    @staticmethod
    def unbook(record: StepRecord) -> None:
        """Give back a decode booked by ``advance`` that will not run (the executor dropped it, as the multi-step
        decode before it was cut): each sequence's computed tokens and slots are as before it. Its blocks stay, for
        the steps that will write there; sequences it preempted stay preempted."""
        for seq, start, slot in zip(record.seqs, record.starts, record.slots, strict=True):
            if not seq.is_finished:
                seq.num_cached_tokens = start
                del seq.token_ids[slot:]
                seq.final_token_pending = seq.verifying = False

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` wherever it is (finished, stop string, abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_scheduled_tokens = 0
        _drop_pending(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.deallocate(seq)
            self.released_seq_ids.append(seq.seq_id)

    def requeue_all(self, block_manager: BlockManager) -> list[Sequence]:
        """Start over on a new KV cache (the executor lost its own): every live sequence waits again, oldest first
        (by priority first in priority order), to be recomputed like a preempted one. Returns the sequences that no
        longer fit in the new cache; they are finished with ABORT."""
        oldest = priority_key if self.by_priority else (lambda seq: seq.seq_id)
        live = sorted([*self.running, *self.waiting], key=oldest)
        block_manager.carry_listener(self.block_manager)
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.running.clear()
        self.waiting.clear()
        self.released_seq_ids.clear()
        dropped = []
        for seq in live:
            _drop_pending(seq)
            seq.block_table.clear()
            seq.num_cached_tokens = seq.num_scheduled_tokens = 0
            seq.block_size = self.block_size
            seq.status = SequenceStatus.WAITING
            try:
                self.add(seq)
            except ValueError:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.ABORT
                dropped.append(seq)
        return dropped

    def drain_released(self) -> list[int]:
        released, self.released_seq_ids = self.released_seq_ids, []
        return released

    def release_again(self, seq_ids: list[int]) -> None:
        """A plan that told the executor to drop ``seq_ids`` was itself dropped: the next plan tells it again."""
        self.released_seq_ids[:0] = seq_ids


def _drop_pending(seq: Sequence) -> None:
    """Forget tokens of steps that will not be settled (the sequence ended, or the executor was lost)."""
    tokens = seq.token_ids
    while tokens[-1] == PENDING:
        tokens.pop()
    seq.final_token_pending = seq.verifying = False
    seq.num_draft_tokens = 0
