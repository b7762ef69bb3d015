"""nano-vLLM's Scheduler and BlockManager, written plainly from the seed texts (DESIGN.md, "The reference
semantics"), to run the same workloads beside nanoserve and count what each computes.

It shares no code with ``scheduler_svc``: its own sequences, its own block manager, and prefixes named by their
token tuples rather than chained hashes. A prefix (every token up to a block's end) names at most one block, the one
registered last, as nano-vLLM's hash map does; a free block keeps its registration until it is reused. Its tokens
come from the shadow executor's ``next_token`` on the whole context, so both sides generate the same completions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from executor_svc.fakes.shadow import next_token


@dataclass
class RefSeq:
    """A request: its tokens, how many have KV, this step's share and its block table."""

    seq_id: int
    token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    block_size: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_scheduled_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def prefix(self, i: int) -> tuple[int, ...]:
        """Every token up to the end of logical block ``i``: what names its KV."""
        return tuple(self.token_ids[: (i + 1) * self.block_size])


class RefBlockManager:
    """Ref-counted blocks, a FIFO free list and a one-block-per-prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.prefix_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_of: dict[tuple[int, ...], int] = {}
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_used_blocks(self) -> int:
        return sum(count > 0 for count in self.ref_counts)

    def _take(self, block: int) -> None:
        """Hand out a free block; a reused one loses its registration (its KV is about to be overwritten)."""
        self.free.remove(block)
        prefix = self.prefix_of[block]
        if prefix is not None and self.block_of.get(prefix) == block:
            del self.block_of[prefix]
        self.prefix_of[block] = None
        self.ref_counts[block] = 1

    def _hits(self, seq: RefSeq) -> list[int]:
        """Blocks of the longest registered prefix; never the last block, so a prefill computes a token."""
        hits = []
        for i in range(seq.num_blocks - 1):
            block = self.block_of.get(seq.prefix(i))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: RefSeq) -> int:
        """How many blocks hit, or -1 when the free list cannot hold the rest (a free hit needs a free block)."""
        hits = self._hits(seq)
        if len(self.free) < seq.num_blocks - sum(self.ref_counts[b] > 0 for b in hits):
            return -1
        return len(hits)

    def allocate(self, seq: RefSeq, num_cached_blocks: int) -> None:
        hits = self._hits(seq)[:num_cached_blocks]
        for block in hits:
            if self.ref_counts[block]:
                self.ref_counts[block] += 1
            else:
                self.free.remove(block)  # revived with its registration: its KV is what the hit wants
                self.ref_counts[block] = 1
            seq.block_table.append(block)
        while len(seq.block_table) < seq.num_blocks:
            block = self.free[0]
            self._take(block)
            seq.block_table.append(block)
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: RefSeq) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def _needs_block(self, seq: RefSeq) -> bool:
        """A decode writes the KV of its last token, position num_tokens - 1: a new block when the table ends before."""
        return len(seq.block_table) * self.block_size < seq.num_tokens

    def can_append(self, seq: RefSeq) -> bool:
        return len(self.free) >= self._needs_block(seq)

    def may_append(self, seq: RefSeq) -> None:
        if self._needs_block(seq):
            block = self.free[0]
            self._take(block)
            seq.block_table.append(block)

    def hash_blocks(self, seq: RefSeq) -> None:
        """Register the blocks this step's tokens filled (last registration wins)."""
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for i in range(start, end):
            block = seq.block_table[i]
            self.prefix_of[block] = seq.prefix(i)
            self.block_of[seq.prefix(i)] = block


class RefScheduler:
    """Prefill first (FIFO, one chunked sequence, the first), else decode with preemption of the tail."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos
        self.vocab_size = vocab_size
        self.block_manager = RefBlockManager(num_blocks, block_size)
        self.waiting: deque[RefSeq] = deque()
        self.running: deque[RefSeq] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: RefSeq) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[RefSeq], bool]:
        scheduled: list[RefSeq] = []
        num_batched_tokens = 0
        bm = self.block_manager
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = bm.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled:
                break
            if not seq.block_table:
                bm.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                self.waiting.popleft()
                self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                bm.may_append(seq)
                scheduled.append(seq)
        assert scheduled, "nothing to schedule"
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: RefSeq) -> None:
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def step(self) -> tuple[list[tuple[int, int]], bool]:
        """Schedule, compute and postprocess one step; return (seq id, tokens computed) per sequence."""
        seqs, is_prefill = self.schedule()
        computed = [(seq.seq_id, seq.num_scheduled_tokens) for seq in seqs]
        token_ids = [next_token(np.array(seq.token_ids), self.vocab_size, None) for seq in seqs]
        for seq, token_id in zip(seqs, token_ids, strict=True):
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.token_ids.append(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or len(seq.completion_token_ids) == seq.max_tokens:
                seq.finished = True
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
        return computed, is_prefill
