"""The prefix cache never does worse than nano-vLLM's own: no more prefill tokens, no more blocks held.

The reference is a plain model of nano-vLLM's BlockManager policy (a prefix names one block, the
one registered last; FIFO free list; a reused block loses its registration), registering a block
once its KV is computed. It runs in lockstep with ours: it sees each allocation and release our
scheduler makes, in the same order, and makes its own prefix-cache choices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from executor_svc.shadow import ShadowExecutor
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig, StepRecord, TokenOutput
from scheduler_svc.sequence import PENDING, Sequence
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import expected
from tests.test_engine_properties import check_invariants

VOCAB = 40


class ReferenceOutOfBlocks(Exception):
    """The reference cannot follow an allocation ours made (ours held fewer blocks): the comparison ends."""


class ReferenceBlockManager:
    """nano-vLLM's block policy, written plainly. A prefix (every token up to a block's end) names
    at most one block: the one registered last. A free block keeps its registration until it is
    reused. It mirrors the sequences' block tables by length only: which fresh block a sequence gets
    does not change what the cache can find, only how many leave the free list, and when."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.prefix_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_of: dict[tuple[int, ...], int] = {}
        self.tables: dict[int, tuple[Sequence, list[int]]] = {}
        self.released: dict[int, list[int]] = {}  # freed this step, their KV not registered yet
        self.computed: dict[int, int] = {}  # per sequence: tokens whose KV its blocks hold

    @property
    def num_used(self) -> int:
        return sum(count > 0 for count in self.ref_counts)

    def _prefix(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[: (i + 1) * self.block_size])

    def _take(self) -> int:
        if not self.free:
            raise ReferenceOutOfBlocks
        block = self.free.popleft()
        prefix = self.prefix_of[block]
        if prefix is not None and self.block_of.get(prefix) == block:
            del self.block_of[prefix]
        self.prefix_of[block] = None
        self.ref_counts[block] = 1
        return block

    def sync_appends(self) -> None:
        """Take the blocks our decode appended since the last call, before anything else moves."""
        for seq, table in self.tables.values():
            while len(table) < len(seq.block_table):
                table.append(self._take())

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` its blocks, hits first; return how many blocks hit."""
        self.sync_appends()
        hits = []
        for i in range(seq.num_blocks - 1):  # the prompt's last block is never a hit
            block = self.block_of.get(self._prefix(seq, i))
            if block is None:
                break
            hits.append(block)
        if len(self.free) < seq.num_blocks - sum(self.ref_counts[b] > 0 for b in hits):
            raise ReferenceOutOfBlocks
        for block in hits:
            if self.ref_counts[block] == 0:
                self.free.remove(block)
            self.ref_counts[block] += 1
        self.tables[seq.seq_id] = (seq, hits + [self._take() for _ in range(len(hits), seq.num_blocks)])
        self.computed[seq.seq_id] = len(hits) * self.block_size
        return len(hits)

    def deallocate(self, seq: Sequence) -> None:
        self.sync_appends()
        _, table = self.tables.pop(seq.seq_id)
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        self.released[seq.seq_id] = table

    def register(self, seq: Sequence, end: int) -> None:
        """The step computed ``seq``'s KV up to token ``end``: register the blocks that filled (the
        reference computes the blocks it missed and ours hit in the same step)."""
        held = self.tables.get(seq.seq_id)
        table = held[1] if held else self.released[seq.seq_id]
        done = self.computed[seq.seq_id]
        for i in range(done // self.block_size, end // self.block_size):
            prefix = self._prefix(seq, i)
            assert PENDING not in prefix
            self.prefix_of[table[i]] = prefix
            self.block_of[prefix] = table[i]
        self.computed[seq.seq_id] = max(done, end)


class LockstepBlockManager(BlockManager):
    """Ours, with every allocation and release mirrored into the reference in the same order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.reference: ReferenceBlockManager | None = ReferenceBlockManager(num_blocks, block_size)
        self.hits: list[tuple[Sequence, int, int]] = []  # per allocation: ours, the reference's
        self.held: list[tuple[int, int]] = []  # blocks in use: ours, the reference's

    def mirror(self, op: Callable[..., Any], *args: Any) -> Any:
        """Apply ``op`` to the reference, until it cannot follow."""
        if self.reference is None:
            return None
        try:
            return op(self.reference, *args)
        except ReferenceOutOfBlocks:
            event("the reference ran out of blocks ours did not need")
            self.reference = None
            return None

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        super().allocate(seq, num_cached_blocks)
        theirs = self.mirror(ReferenceBlockManager.allocate, seq)
        if theirs is not None:
            self.hits.append((seq, num_cached_blocks, theirs))

    def deallocate(self, seq: Sequence) -> None:
        self.mirror(ReferenceBlockManager.deallocate, seq)
        super().deallocate(seq)

    def record_held(self) -> None:
        self.mirror(ReferenceBlockManager.sync_appends)
        if self.reference is not None:
            self.held.append((len(self.used_block_ids), self.reference.num_used))


class LockstepScheduler(Scheduler):
    """Compares the blocks held at each step's peak (scheduled, nothing freed yet), and registers the
    reference's computed blocks after each step, in the order ours settles them."""

    def settle(self, record: StepRecord, token_ids: list[int], logprobs: Any = (),
               num_passes: int | None = None) -> list[TokenOutput]:
        bm = self.block_manager
        bm.record_held()
        outputs = super().settle(record, token_ids, logprobs, num_passes)
        for seq, start, count in zip(record.seqs, record.starts, record.counts, strict=True):
            # Tokens a multi-step decode sampled past a stop were dropped, and their KV with them.
            bm.mirror(ReferenceBlockManager.register, seq, min(start + count, len(seq.token_ids)))
        if bm.reference is not None:
            bm.reference.released.clear()
        return outputs


def lockstep_engine(num_blocks: int, block_size: int, config: SchedulerConfig) -> tuple[Engine, ShadowExecutor]:
    executor = ShadowExecutor(num_blocks, block_size, VOCAB, (EOS,), max_model_len=4096)
    engine = Engine(executor, config)
    engine.scheduler = LockstepScheduler(
        config, LockstepBlockManager(num_blocks, block_size), {EOS}, executor.info.max_model_len
    )
    return engine, executor


@st.composite
def workloads(draw):
    """Few shared prefixes, a tight cache and spread arrivals: twins, evictions, and later hits."""
    block_size = draw(st.integers(2, 8))
    num_blocks = draw(st.integers(4, 24))
    budget = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 8))
    prefixes = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=16), min_size=1, max_size=2))
    requests = draw(st.lists(
        st.tuples(
            st.integers(0, len(prefixes)),  # which shared prefix; len(prefixes) means none
            st.lists(st.integers(1, 3), max_size=6),
            st.integers(1, 16),  # max_tokens
            st.booleans(),  # ignore_eos
            st.integers(0, 16),  # arrival step
        ),
        min_size=1, max_size=16,
    ))
    return block_size, num_blocks, budget, max_num_seqs, prefixes, requests


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 3]))
# Found on the first-registration-wins cache: request 3 misses the copy request 2 still holds.
@example((6, 4, 4, 1, [[1] * 6], [(0, [], 1, False, 0), (0, [], 1, False, 0), (0, [], 8, False, 0),
                                  (0, [1], 1, False, 9)]), 3)
# And there request 2 revives request 0's free copy instead of sharing request 1's: a block more.
@example((2, 4, 4, 1, [[1, 1]], [(0, [], 1, False, 0), (0, [], 2, False, 0), (0, [1], 1, False, 0)]), 1)
def test_no_more_prefill_tokens_or_blocks_than_nano_vllm(workload, num_steps):
    block_size, num_blocks, budget, max_num_seqs, prefixes, requests = workload
    engine, executor = lockstep_engine(num_blocks, block_size, SchedulerConfig(max_num_seqs, budget, num_steps))
    bm = engine.block_manager
    pending = []
    for prefix_choice, tail, max_tokens, ignore_eos, arrival in requests:
        prompt = (prefixes[prefix_choice] if prefix_choice < len(prefixes) else []) + tail
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        if prompt and max(len(prompt), len(prompt) + max_tokens - 1) <= num_blocks * block_size:
            pending.append((arrival, prompt, params))
    submitted = []
    step = 0
    while pending or engine.has_unfinished():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            submitted.append((item[1], item[2], engine.add_request(item[1], item[2])))
        engine.step()
        check_invariants(engine, executor)
        for seq, ours, theirs in bm.hits:
            assert ours >= theirs, f"step {step}: request {seq.seq_id} hit {ours} blocks, nano-vLLM {theirs}"
        bm.record_held()
        for ours, theirs in bm.held:
            assert ours <= theirs, f"step {step}: {ours} blocks held, nano-vLLM {theirs}"
        bm.hits.clear()
        bm.held.clear()
        step += 1
    engine.step()
    for prompt, params, seq in submitted:
        assert seq.completion_token_ids == expected(engine, prompt, params)
    assert_all_blocks_free(bm)


_ids = iter(range(10**9))


def seq(n_tokens: int, max_tokens: int = 8, start: int = 1) -> Sequence:
    tokens = [start + i for i in range(n_tokens)]
    return Sequence(next(_ids), tokens, SamplingParams(temperature=0, max_tokens=max_tokens), 4)


def test_twin_still_hits_after_the_copy_registered_first_is_reused(make_scheduler):
    s = make_scheduler(num_blocks=8, block_size=4)
    a, b = seq(9, max_tokens=1), seq(9)
    s.add(a)
    s.add(b)
    s.schedule()
    first_copies = a.block_table[:2]
    s.postprocess([a, b], [7, 7], True)  # both computed the prefix; a ends, its copies are free
    assert a.is_finished and not b.is_finished
    d = seq(20, max_tokens=1, start=100)
    s.add(d)
    assert s.schedule() == ([d], True) and set(first_copies) <= set(d.block_table), "d reuses a's copies"
    s.postprocess([d], [7], True)
    bm = s.block_manager
    c = seq(9)
    assert bm.can_allocate(c) == 2, "b's copies still hold the prefix"
    assert [bm.hash_to_block_ids[bm.blocks[i].hash] for i in b.block_table[:2]] == [[i] for i in b.block_table[:2]]
    s.add(c)
    s.schedule()
    assert c.block_table[:2] == b.block_table[:2] and c.num_scheduled_tokens == 1


def test_a_hit_shares_a_copy_in_use_before_reviving_a_free_one(make_scheduler):
    s = make_scheduler(num_blocks=8, block_size=4)
    a, b = seq(4), seq(4, max_tokens=1)  # one block each, their last: neither can hit, both compute it
    s.add(a)
    s.add(b)
    seqs, _ = s.schedule()
    s.postprocess(seqs, [7, 7], True)  # b ends: its copy, registered last, is free; a's is in use
    bm = s.block_manager
    assert b.is_finished and len(bm.hash_to_block_ids[bm.blocks[a.block_table[0]].hash]) == 2
    c = seq(5)
    s.add(c)
    free = bm.num_free_blocks
    s.schedule()
    assert c.block_table[0] == a.block_table[0] and bm.num_free_blocks == free - 1, "only c's last block is new"


def test_a_continued_chunk_registers_before_the_new_requests_of_its_step(make_shadow_engine):
    engine, _ = make_shadow_engine(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    c = engine.add_request(list(range(1, 13)), params)
    engine.step()  # c's first chunk: blocks 0 and 1
    t = engine.add_request(list(range(1, 13)), params)
    engine.step()  # c's last block, and t hits blocks 0 and 1 and computes its last block, a twin of c's
    bm = engine.block_manager
    h = bm.blocks[c.block_table[2]].hash
    # The plan lists t, new, before c; nano-vLLM's postprocess takes c first, as it scheduled it: the blocks of a
    # step are registered (and freed) in that order.
    assert bm.hash_to_block_ids[h] == [c.block_table[2], t.block_table[2]]
