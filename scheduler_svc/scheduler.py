"""nano-vLLM's scheduler: prefill-first continuous batching with preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Per-step budgets (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


class Scheduler:
    """Decides which sequences run each step and how many tokens each computes.

    Prefill comes first, FIFO from the head of ``waiting``; only the first
    sequence of a batch may be chunked, and a chunked sequence stays at the
    head until its prompt is computed. Decode runs only when no prefill was
    scheduled; when a block cannot be appended, the tail of ``running`` is
    preempted (its blocks freed, recomputed later).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        # Ids of sequences whose blocks were freed since the last drain, so the
        # executor can drop their state (finished, aborted or preempted).
        self.released_seq_ids: list[int] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; refuse one that could never fit in the whole cache."""
        # The last sampled token is never fed back, so its KV never needs a slot.
        max_kv_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len) - 1
        blocks_needed = max(seq.num_blocks, (max_kv_len + self.block_size - 1) // self.block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"sequence needs {blocks_needed} KV blocks at its longest but the cache has "
                f"{self.block_manager.num_blocks}; shorten the prompt or max_tokens"
            )
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return this step's sequences and whether the step is a prefill."""
        scheduled: list[Sequence] = []
        num_batched_tokens = 0

        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled:
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks)
                self.num_prefix_hit_tokens += seq.num_cached_tokens
                if seq.num_prefix_hit_tokens is None:
                    seq.num_prefix_hit_tokens = seq.num_cached_tokens
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        # The decode loop runs once per running sequence every step: BlockManager.can_append and
        # may_append are inlined (a block is needed only when the last one is full) to keep it cheap.
        block_manager, block_size, running = self.block_manager, self.block_size, self.running
        free_block_ids = block_manager.free_block_ids
        while running and len(scheduled) < self.max_num_seqs:
            seq = running.popleft()
            needs_block = len(seq.token_ids) % block_size == 1
            while needs_block and not free_block_ids:
                if running:
                    self.preempt(running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                if needs_block:
                    block_manager.may_append(seq)
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("nothing can be scheduled: a sequence needs more KV blocks than exist")
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._release(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Apply the sampled tokens; return the sequences that gained a token.

        This runs for every scheduled sequence every step, so the per-sequence work is
        inlined: blocks are hashed only when this step filled one, and the stop checks read
        local names.
        """
        advanced = []
        block_size, hash_blocks = self.block_size, self.block_manager.hash_blocks
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        for seq, token_id in zip(seqs, token_ids, strict=True):
            num_cached = seq.num_cached_tokens
            end = num_cached + seq.num_scheduled_tokens
            if num_cached // block_size != end // block_size:
                hash_blocks(seq)
            seq.num_cached_tokens = end
            seq.num_scheduled_tokens = 0
            tokens = seq.token_ids
            if is_prefill and end < len(tokens):
                continue
            tokens.append(token_id)
            advanced.append(seq)
            params = seq.params
            if (not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids:
                self.finish(seq, FinishReason.STOP)
            elif len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= max_model_len:
                self.finish(seq, FinishReason.LENGTH)
        return advanced

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
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.deallocate(seq)
            self.released_seq_ids.append(seq.seq_id)

    def requeue_all(self, block_manager: BlockManager) -> list[Sequence]:
        """Start over on a new KV cache (the executor lost its own): every live sequence waits
        again, oldest first, to be recomputed like a preempted one. Returns the sequences that no
        longer fit in the new cache; they are finished with ABORT."""
        live = sorted([*self.running, *self.waiting], key=lambda seq: seq.seq_id)
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.running.clear()
        self.waiting.clear()
        self.released_seq_ids.clear()
        dropped = []
        for seq in live:
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
