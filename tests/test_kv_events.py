"""The prefix cache's KV events: a router that applies them holds exactly the entries the cache can serve from.

A ``Mirror`` plays the router: it applies each batch in order and checks every stored hash against the chained hash
of its parent and tokens. After any workload (shared prefixes, twins in one step, a cache small enough to evict,
flushes, an executor restart) the mirror's entries are the block manager's registered hashes, and a prompt whose
blocks the mirror holds is served from the cache.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.block_manager import NO_HASH, BlockManager, chain_hash
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.kv_events import KvEventBatch, KvEventLog
from tests.conftest import assert_all_blocks_free

BLOCK = 4


class Mirror:
    """What a router knows of one worker's prefix cache: hash -> (parent hash, token ids)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[int | None, list[int]]] = {}
        self.next_sequence_number: int | None = None

    def apply(self, batches: list[KvEventBatch]) -> None:
        for batch in batches:
            if self.next_sequence_number is not None:
                assert batch.sequence_number == self.next_sequence_number, "a gap with nobody falling behind"
            self.next_sequence_number = batch.sequence_number + 1
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.entries.clear()
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        assert self.entries.pop(h, None) is not None, "removed an entry never stored"
                else:
                    self.store(event)

    def store(self, event: BlockStored) -> None:
        parent = event.parent_block_hash
        assert parent is None or parent in self.entries, "a block stored before its parent"
        for i, h in enumerate(event.block_hashes):
            tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
            assert h == chain_hash(tokens, NO_HASH if parent is None else parent), "not the cache's chained hash"
            assert h not in self.entries, "an entry stored twice"
            self.entries[h] = (parent, tokens)
            parent = h

    def cached_blocks(self, prompt: list[int]) -> int:
        """Full blocks of ``prompt`` the router expects this worker to hold (never the prompt's last, as the cache)."""
        h, count = NO_HASH, 0
        for i in range((len(prompt) - 1) // BLOCK):
            h = chain_hash(prompt[i * BLOCK:(i + 1) * BLOCK], h)
            if h not in self.entries:
                break
            count += 1
        return count


def engine_with(num_blocks: int, overlap: bool = False) -> Engine:
    executor = ShadowExecutor(num_blocks=num_blocks, block_size=BLOCK, vocab_size=50)
    return Engine(executor, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), overlap=overlap)


def listening(engine: Engine) -> tuple[list[KvEventBatch], Mirror]:
    """Subscribe as a router would: the block manager records from now on."""
    received: list[KvEventBatch] = []
    engine.block_manager.listen()
    subscription = engine.kv_events.subscribe(lambda: received.extend(subscription.take()))
    return received, Mirror()


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 3) -> list[int]:
    """Serve ``prompts`` together, collecting events after each step as the loop does; cached prompt tokens each."""
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
        engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    return [seq.num_prefix_hit_tokens for seq in seqs]


def registered(block_manager: BlockManager) -> set[int]:
    return set(block_manager.hash_to_block_ids)


def test_nothing_is_recorded_until_someone_subscribes() -> None:
    engine = engine_with(32)
    run(engine, [list(range(1, 14))])
    assert engine.block_manager.events is None
    assert engine.block_manager.take_events() == []
    assert registered(engine.block_manager), "the cache itself works as before"
    assert_all_blocks_free(engine.block_manager)


def test_stored_blocks_chain_from_their_parent_and_a_shared_prefix_adds_only_its_new_blocks() -> None:
    engine = engine_with(32)
    received, mirror = listening(engine)
    prefix = list(range(1, 9))  # two full blocks
    run(engine, [prefix + [20, 21, 22, 23, 24]])
    first = [event for batch in received for event in batch.events]
    assert isinstance(first[0], BlockStored) and first[0].parent_block_hash is None
    assert first[0].token_ids[:8] == prefix and first[0].block_size == BLOCK
    mirror.apply(received)
    received.clear()
    assert run(engine, [prefix + [30, 31, 32, 33, 34]]) == [8]
    stored = [event for batch in received for event in batch.events if isinstance(event, BlockStored)]
    assert stored[0].parent_block_hash == chain_hash(prefix[4:], chain_hash(prefix[:4], NO_HASH))
    assert stored[0].token_ids[:4] == [30, 31, 32, 33]
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager)
    assert_all_blocks_free(engine.block_manager)


def test_twins_in_one_step_store_each_entry_once_and_reuse_removes_it_with_its_last_copy() -> None:
    engine = engine_with(12)
    received, mirror = listening(engine)
    twin = list(range(1, 14))
    run(engine, [twin, list(twin)])
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager)
    received.clear()
    run(engine, [[40 + i % 9 for i in range(45)]])  # all 12 blocks: every old one is reused
    removed = [h for batch in received for event in batch.events if isinstance(event, BlockRemoved)
               for h in event.block_hashes]
    assert len(removed) == len(set(removed)) and set(removed) <= set(mirror.entries)
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager)
    assert mirror.cached_blocks(twin) == 0
    assert_all_blocks_free(engine.block_manager)


def test_a_flush_drops_what_no_request_holds_and_a_repeat_then_misses() -> None:
    engine = engine_with(32)
    received, mirror = listening(engine)
    prompt = list(range(1, 14))
    run(engine, [prompt])
    dropped = engine.block_manager.flush()
    engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    assert dropped == 3 and not registered(engine.block_manager)
    assert isinstance(received[-1].events[-1], AllBlocksCleared)
    mirror.apply(received)
    assert mirror.entries == {}
    assert run(engine, [prompt]) == [0]
    assert_all_blocks_free(engine.block_manager)


def test_a_flush_keeps_the_entries_of_blocks_in_use() -> None:
    engine = engine_with(32)
    received, mirror = listening(engine)
    run(engine, [list(range(1, 14))])
    held = engine.add_request(list(range(30, 43)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(2):
        engine.step()
    engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    assert engine.block_manager.flush() == 3
    engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager) != set()
    assert all(engine.block_manager.blocks[b].ref_count for ids in engine.block_manager.hash_to_block_ids.values()
               for b in ids)
    while engine.has_unfinished():
        engine.step()
    assert held.is_finished
    assert_all_blocks_free(engine.block_manager)


def test_an_executor_restart_clears_everything_and_events_go_on() -> None:
    engine = engine_with(32)
    received, mirror = listening(engine)
    run(engine, [list(range(1, 14))])
    engine.executor.reset()
    engine.recover()
    engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    assert received[-1].events == (AllBlocksCleared(),)
    run(engine, [list(range(1, 14))])
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager) != set()
    assert_all_blocks_free(engine.block_manager)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), overlap=st.booleans(), num_blocks=st.integers(10, 24))
def test_after_any_workload_the_router_holds_exactly_the_cache_entries(seed: int, overlap: bool,
                                                                       num_blocks: int) -> None:
    """Random prompts on three shared prefixes, evictions and flushes; then the router predicts each prefix's hits."""
    rng = random.Random(seed)
    engine = engine_with(num_blocks, overlap)
    received, mirror = listening(engine)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    for _ in range(rng.randrange(2, 6)):
        prompts = [rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
                   for _ in range(rng.randrange(1, 4))]
        run(engine, prompts, rng.randrange(1, 6))
        if rng.random() < 0.2:
            engine.block_manager.flush()
            engine.kv_events.collect(engine.block_manager, engine.adapters.name_of)
    mirror.apply(received)
    assert set(mirror.entries) == registered(engine.block_manager)
    for prefix in prefixes:
        prompt = prefix + [7]
        applied = len(received)
        assert run(engine, [prompt], 1) == [mirror.cached_blocks(prompt) * BLOCK], "the router predicts the hits"
        mirror.apply(received[applied:])
        assert set(mirror.entries) == registered(engine.block_manager)
    assert_all_blocks_free(engine.block_manager)


def batch_numbers(batches: list[KvEventBatch]) -> list[int]:
    return [batch.sequence_number for batch in batches]


def test_batches_are_numbered_kept_for_a_resume_and_a_slow_subscriber_sees_the_gap() -> None:
    log = KvEventLog(history=5)
    live = log.subscribe(lambda: None)
    slow = log.subscribe(lambda: None, backlog=3)
    for _ in range(8):
        log.publish([BlockRemoved([1])])
    assert batch_numbers(live.take()) == list(range(1, 9))
    assert batch_numbers(slow.take()) == [6, 7, 8], "the oldest were dropped: a gap after what it read"
    resumed = log.subscribe(lambda: None, start_sequence_number=6)
    assert batch_numbers(resumed.take()) == [6, 7, 8]
    too_old = log.subscribe(lambda: None, start_sequence_number=2)
    assert batch_numbers(too_old.take()) == [4, 5, 6, 7, 8], "only the last 5 are kept: 2 and 3 are a gap"
    assert batch_numbers(log.subscribe(lambda: None).take()) == []
    log.publish([BlockRemoved([2]), AllBlocksCleared()])
    batch = resumed.take()[0]
    assert (batch.sequence_number, batch.first_event_id) == (9, 9)
    assert batch_numbers(live.take()) == [9]
    log.unsubscribe(live)
    log.publish([AllBlocksCleared()])
    assert live.take() == [] and batch_numbers(resumed.take()) == [10]


@pytest.mark.parametrize("overlap", [False, True])
def test_events_arrive_batched_per_step(overlap: bool) -> None:
    engine = engine_with(32, overlap)
    received, _ = listening(engine)
    run(engine, [list(range(1, 14)), list(range(20, 33))])
    assert received and all(batch.events for batch in received)
    assert batch_numbers(received) == list(range(1, len(received) + 1))
    assert len(received) <= engine.num_steps
    assert_all_blocks_free(engine.block_manager)
