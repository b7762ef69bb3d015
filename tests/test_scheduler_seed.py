"""One test per behaviour of nano-vLLM's scheduler (the seed semantics in DESIGN.md)."""

from __future__ import annotations

from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import FinishReason, Sequence, SequenceStatus
from tests.conftest import EOS

_ids = iter(range(10**9))


def seq(n_tokens: int, max_tokens: int = 8, block_size: int = 4, start: int = 1, **params) -> Sequence:
    tokens = [start + i for i in range(n_tokens)]
    return Sequence(next(_ids), tokens, SamplingParams(temperature=0, max_tokens=max_tokens, **params), block_size)


def prefill_all(scheduler, token: int = 7) -> None:
    while scheduler.waiting:
        seqs, is_prefill = scheduler.schedule()
        assert is_prefill
        scheduler.postprocess(seqs, [token] * len(seqs), True)


def test_add_appends_to_waiting_and_is_finished_when_both_queues_empty(make_scheduler):
    s = make_scheduler()
    assert s.is_finished()
    a, b = seq(3), seq(3)
    s.add(a)
    s.add(b)
    assert list(s.waiting) == [a, b] and not s.running
    assert not s.is_finished()


def test_prefill_first_fifo_from_head_of_waiting(make_scheduler):
    s = make_scheduler()
    a, b, c = seq(3), seq(5), seq(2)
    for x in (a, b, c):
        s.add(x)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a, b, c]
    assert list(s.running) == [a, b, c] and all(x.status == SequenceStatus.RUNNING for x in seqs)


def test_prefill_bounded_by_max_num_seqs(make_scheduler):
    s = make_scheduler(max_num_seqs=2)
    xs = [seq(2) for _ in range(3)]
    for x in xs:
        s.add(x)
    seqs, _ = s.schedule()
    assert seqs == xs[:2] and list(s.waiting) == xs[2:]


def test_prefill_bounded_by_max_num_batched_tokens(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=10)
    a, b, c = seq(4), seq(6), seq(3)
    for x in (a, b, c):
        s.add(x)
    seqs, _ = s.schedule()
    assert seqs == [a, b]
    assert sum(x.num_scheduled_tokens for x in seqs) == 10
    assert list(s.waiting) == [c]


def test_can_allocate_returns_cached_block_count_or_minus_one(make_scheduler):
    s = make_scheduler(num_blocks=4, block_size=4)
    a = seq(10, max_tokens=2)  # 3 blocks, the first two become cacheable once computed
    s.add(a)
    prefill_all(s)
    bm = s.block_manager
    twin = seq(10, max_tokens=2)
    assert bm.can_allocate(twin) == 2
    assert bm.can_allocate(seq(20, start=100)) == -1  # 5 blocks, 1 free
    s.finish(a, FinishReason.ABORT)


def test_prefill_stops_when_head_cannot_allocate(make_scheduler):
    """FIFO: a head that cannot allocate blocks the prefill, even of a sequence behind it that would fit."""
    s = make_scheduler(num_blocks=4, block_size=4)
    a, b = seq(6, max_tokens=4), seq(2, max_tokens=4, start=50)  # 2 blocks + 1 block, decoding needs no more
    s.add(a)
    s.add(b)
    prefill_all(s)
    d, c = seq(5, max_tokens=1, start=200), seq(2, max_tokens=1, start=300)  # d needs 2 blocks, c needs 1
    s.add(d)
    s.add(c)
    assert s.block_manager.num_free_blocks == 1
    assert s.block_manager.can_allocate(d) == -1 and s.block_manager.can_allocate(c) == 0
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [a, b], "prefill must stop at a head that cannot allocate"
    assert list(s.waiting) == [d, c], "the waiting order is unchanged"
    assert not d.block_table and not c.block_table
    assert s.block_manager.num_free_blocks == 1
    s.postprocess(seqs, [7] * len(seqs), False)


def test_only_first_sequence_of_a_batch_is_chunked(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=8)
    a, b = seq(4), seq(6)
    s.add(a)
    s.add(b)
    seqs, _ = s.schedule()
    assert seqs == [a], "b does not fit whole and is not first, so it waits"
    assert a.num_scheduled_tokens == 4
    s.postprocess(seqs, [7], True)
    c = seq(20, start=300)
    s2 = make_scheduler(max_num_batched_tokens=8)
    s2.add(c)
    seqs, _ = s2.schedule()
    assert seqs == [c] and c.num_scheduled_tokens == 8, "the first sequence is chunked to the budget"


def test_chunked_sequence_stays_at_head_of_waiting_until_prompt_computed(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=16)
    a, b = seq(20), seq(3, start=100)
    s.add(a)
    s.add(b)
    chunks = []
    while a.status == SequenceStatus.WAITING:
        seqs, is_prefill = s.schedule()
        assert is_prefill and seqs[0] is a
        if a.status == SequenceStatus.WAITING:
            assert s.waiting[0] is a and seqs == [a]
        chunks.append(a.num_scheduled_tokens)
        s.postprocess(seqs, [7] * len(seqs), True)
    assert chunks == [8, 8, 4]
    assert b.status == SequenceStatus.RUNNING, "b rode along once a's last chunk left room"
    assert a.num_completion_tokens == 1, "only the chunk that finishes the prompt keeps its token"


def test_prefill_and_decode_never_mixed(make_scheduler):
    s = make_scheduler()
    a = seq(3)
    s.add(a)
    prefill_all(s)
    b = seq(3, start=40)
    s.add(b)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [b], "a waiting prefill runs alone, the running decode waits"
    s.postprocess(seqs, [7], True)
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [a, b]
    s.postprocess(seqs, [7, 7], False)


def test_decode_preempts_tail_of_running_when_append_fails(make_scheduler):
    s = make_scheduler(num_blocks=3, block_size=4)
    a, b = seq(4, max_tokens=5), seq(6, max_tokens=5, start=40)
    s.add(a)
    s.add(b)
    prefill_all(s)  # a: 5 tokens in 1 block, b: 7 tokens in 2 blocks; none free
    assert s.block_manager.num_free_blocks == 0
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [a], "a needs a block, so b (the tail) is preempted"
    assert b.status == SequenceStatus.WAITING and list(s.waiting) == [b] and not b.block_table
    assert s.num_preemptions == 1
    s.postprocess(seqs, [7], False)


def test_append_blocks_grows_the_table_to_hold_the_kv_or_takes_nothing(make_scheduler):
    s = make_scheduler(num_blocks=4, block_size=4)
    a = seq(4)
    s.add(a)
    s.schedule()
    bm = s.block_manager
    assert bm.append_blocks(a, 4) and len(a.block_table) == 1, "its one block holds 4 tokens"
    assert bm.append_blocks(a, 9) and len(a.block_table) == 3 and bm.num_free_blocks == 1
    assert not bm.append_blocks(a, 17) and len(a.block_table) == 3 and bm.num_free_blocks == 1
    s.finish(a, FinishReason.ABORT)


def test_decode_preempts_itself_when_alone(make_scheduler):
    s = make_scheduler(num_blocks=3, block_size=4)
    a, b = seq(4, max_tokens=5), seq(4, max_tokens=5, start=40)
    s.add(a)
    s.add(b)
    prefill_all(s)  # both hold one full block and need a second one; one block is free
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [a], "a takes the last block"
    assert b.status == SequenceStatus.WAITING and not b.block_table, "b, left alone in running, preempts itself"
    assert list(s.running) == [a] and list(s.waiting) == [b]
    s.postprocess(seqs, [7], False)


def test_preemption_is_recompute_blocks_freed_waiting_appendleft(make_scheduler):
    s = make_scheduler(num_blocks=8)
    a, b, c = seq(4), seq(4, start=20), seq(4, start=40)
    for x in (a, b):
        s.add(x)
    prefill_all(s)
    s.add(c)
    held = list(b.block_table)
    s.preempt(b)
    assert b.status == SequenceStatus.WAITING and not b.block_table and b.num_cached_tokens == 0
    assert list(s.waiting) == [b, c], "preempted sequences go to the front"
    assert all(s.block_manager.blocks[i].ref_count == 0 for i in held)
    assert s.drain_released() == [b.seq_id]
    s.running.remove(b)


def test_scheduled_sequences_return_to_front_of_running_in_order(make_scheduler):
    s = make_scheduler(max_num_seqs=2)
    xs = [seq(2, start=10 * i + 1) for i in range(3)]
    for x in xs:
        s.add(x)
    prefill_all(s)
    assert list(s.running) == xs
    seqs, _ = s.schedule()
    assert seqs == xs[:2] and list(s.running) == xs
    s.postprocess(seqs, [7, 7], False)


def test_postprocess_hashes_blocks_that_became_full(make_scheduler):
    s = make_scheduler(block_size=4)
    a = seq(6)
    s.add(a)
    prefill_all(s)
    bm = s.block_manager
    assert bm.blocks[a.block_table[0]].hash != -1 and bm.blocks[a.block_table[1]].hash == -1
    seqs, _ = s.schedule()  # decode writes token 7 at position 6
    s.postprocess(seqs, [7], False)
    assert bm.blocks[a.block_table[1]].hash == -1, "block 1 holds 7 of 8 tokens"
    seqs, _ = s.schedule()
    s.postprocess(seqs, [7], False)
    assert bm.blocks[a.block_table[1]].hash != -1
    assert bm.hash_to_block_ids[bm.blocks[a.block_table[1]].hash] == [a.block_table[1]]


def test_postprocess_counts_scheduled_tokens_as_cached(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=5)
    a = seq(9)
    s.add(a)
    seqs, _ = s.schedule()
    s.postprocess(seqs, [7], True)
    assert a.num_cached_tokens == 5 and a.num_scheduled_tokens == 0


def test_postprocess_drops_token_of_unfinished_chunk(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=5)
    a = seq(9)
    s.add(a)
    seqs, _ = s.schedule()
    s.postprocess(seqs, [33], True)
    assert a.num_tokens == 9 and a.num_completion_tokens == 0
    seqs, _ = s.schedule()
    s.postprocess(seqs, [33], True)
    assert a.completion_token_ids == [33]


def test_postprocess_finishes_on_eos_and_frees_blocks(make_scheduler):
    s = make_scheduler()
    a = seq(3)
    s.add(a)
    seqs, _ = s.schedule()
    s.postprocess(seqs, [EOS], True)
    assert a.is_finished and a.finish_reason == FinishReason.STOP and not a.block_table
    assert s.is_finished()


def test_postprocess_ignore_eos_keeps_generating(make_scheduler):
    s = make_scheduler()
    a = seq(3, max_tokens=3, ignore_eos=True)
    s.add(a)
    for _ in range(3):
        seqs, is_prefill = s.schedule()
        s.postprocess(seqs, [EOS], is_prefill)
    assert a.completion_token_ids == [EOS] * 3 and a.finish_reason == FinishReason.LENGTH


def test_postprocess_finishes_at_max_tokens(make_scheduler):
    s = make_scheduler()
    a = seq(3, max_tokens=2)
    s.add(a)
    for _ in range(2):
        seqs, is_prefill = s.schedule()
        s.postprocess(seqs, [7], is_prefill)
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH and a.num_completion_tokens == 2


def test_block_ref_counts_shared_prefix(make_scheduler):
    s = make_scheduler(block_size=4)
    a = seq(9)
    s.add(a)
    prefill_all(s)
    b = seq(9)
    s.add(b)
    prefill_all(s)
    bm = s.block_manager
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    s.finish(a, FinishReason.ABORT)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]


def test_chained_hash_depends_on_the_whole_prefix(make_scheduler):
    s = make_scheduler(block_size=4)
    a = seq(9)
    s.add(a)
    prefill_all(s)
    other = Sequence(next(_ids), [99, 98, 97, 96] + a.token_ids[4:9], SamplingParams(temperature=0), 4)
    assert s.block_manager.can_allocate(other) == 0, "same second block after a different first is no hit"


def test_last_block_of_prompt_is_never_a_cache_hit(make_scheduler):
    s = make_scheduler(block_size=4)
    a = seq(8)  # exactly two full blocks
    s.add(a)
    prefill_all(s)
    twin = seq(8)
    assert s.block_manager.can_allocate(twin) == 1
    s.add(twin)
    seqs, _ = s.schedule()
    assert twin.num_cached_tokens == 4 and twin.num_scheduled_tokens == 4


def test_full_prompt_cache_hit_never_yields_zero_length_query(make_scheduler):
    s = make_scheduler(block_size=4)
    a = seq(12, max_tokens=1)
    s.add(a)
    prefill_all(s)
    for n in (12, 9, 5, 4, 1):
        twin = seq(n, max_tokens=1)
        s.add(twin)
        seqs, is_prefill = s.schedule()
        assert is_prefill and twin.num_scheduled_tokens >= 1
        s.postprocess(seqs, [7] * len(seqs), True)


def test_hash_registered_only_after_kv_computed(make_scheduler):
    s = make_scheduler(block_size=4, max_num_batched_tokens=4)
    a = seq(13)
    s.add(a)
    seqs, _ = s.schedule()  # first chunk: block 0 scheduled, not yet computed
    bm = s.block_manager
    assert bm.blocks[a.block_table[0]].hash == -1 and not bm.hash_to_block_ids
    assert bm.can_allocate(seq(13)) == 0
    s.postprocess(seqs, [7], True)
    assert bm.blocks[a.block_table[0]].hash in bm.hash_to_block_ids
    assert bm.can_allocate(seq(13)) == 1


def test_reused_block_id_drops_its_stale_hash(make_scheduler):
    s = make_scheduler(num_blocks=3, block_size=4)
    a = seq(5, max_tokens=1)
    s.add(a)
    prefill_all(s)  # a finishes after its first token: both blocks free, block 0 still cached
    bm = s.block_manager
    assert a.is_finished and len(bm.hash_to_block_ids) == 1
    b = seq(12, max_tokens=1, start=500)  # needs all three blocks: the cached one is reused
    s.add(b)
    prefill_all(s)
    for h, block_ids in bm.hash_to_block_ids.items():
        assert all(bm.blocks[block_id].hash == h for block_id in block_ids)
    assert bm.can_allocate(seq(5, max_tokens=1)) == 0, "a's prefix is gone once its block was reused"


def test_two_sequences_sharing_a_prefix_in_one_step_keep_both_copies_findable(make_scheduler):
    s = make_scheduler(block_size=4)
    a, b = seq(9), seq(9)
    s.add(a)
    s.add(b)
    seqs, _ = s.schedule()
    assert seqs == [a, b] and a.block_table[0] != b.block_table[0], "neither could hit the other yet"
    s.postprocess(seqs, [7, 7], True)
    bm = s.block_manager
    h = bm.blocks[a.block_table[0]].hash
    assert h == bm.blocks[b.block_table[0]].hash
    assert bm.hash_to_block_ids[h] == [a.block_table[0], b.block_table[0]], "each copy once, in registration order"
    c = seq(9)
    assert bm.can_allocate(c) == 2
    s.add(c)
    s.schedule()
    assert c.block_table[:2] == b.block_table[:2], "a hit takes the copy registered last, as nano-vLLM's map does"


def test_add_refuses_a_sequence_larger_than_the_cache(make_scheduler):
    s = make_scheduler(num_blocks=2, block_size=4)
    try:
        s.add(seq(6, max_tokens=10))
    except ValueError as e:
        assert "KV blocks" in str(e)
    else:
        raise AssertionError("a sequence that can never fit must be refused")
