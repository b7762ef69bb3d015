"""Property: on any workload and tiny config, the engine reproduces the sequential reference."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.block_manager import NO_HASH
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import expected

VOCAB = 40
MAX_STEPS = 20_000  # far above any drawn workload's need: reaching it means the engine stopped making progress


@st.composite
def workloads(draw):
    block_size = draw(st.integers(4, 32))
    num_blocks = draw(st.integers(4, 64))
    budget = draw(st.integers(8, 256))
    max_num_seqs = draw(st.integers(1, 16))
    prefixes = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=48), min_size=1, max_size=3))
    requests = draw(st.lists(
        st.tuples(
            st.integers(0, len(prefixes)),  # which shared prefix; len(prefixes) means none
            st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24),
            st.integers(1, 40),  # max_tokens
            st.booleans(),  # ignore_eos
            st.integers(0, 6),  # arrival step
            st.integers(-2, 2),  # priority, under --request-order priority
        ),
        min_size=1, max_size=12,
    ))
    # Speculation off, n-gram proposals (any 1-gram matches: many rejected), or a shadow draft model that misses
    # one context in ``miss_every``; with k proposals at most per step.
    speculation = draw(st.sampled_from([None, "ngram", "draft"]))
    k = draw(st.integers(1, 5))
    miss_every = draw(st.integers(1, 4))
    order = draw(st.sampled_from(["fcfs", "priority"]))
    return block_size, num_blocks, budget, max_num_seqs, prefixes, requests, (speculation, k, miss_every), order


def check_invariants(engine: Engine, executor: ShadowExecutor) -> None:
    bm = engine.block_manager
    live = list(engine.scheduler.waiting) + list(engine.scheduler.running)
    holders = [0] * bm.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            holders[block_id] += 1
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id] >= 0
    assert set(bm.free_block_ids).isdisjoint(bm.used_block_ids)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == bm.num_blocks
    bs = bm.block_size
    registered = [(h, block_id) for h, block_ids in bm.hash_to_block_ids.items() for block_id in block_ids]
    assert len(registered) == len({block_id for _, block_id in registered}) == bm.num_cached_blocks, \
        "a block is registered twice"
    assert {block_id for _, block_id in registered} == {b.block_id for b in bm.blocks if b.hash != NO_HASH}, \
        "a computed block is not findable"
    for h, block_id in registered:
        block = bm.blocks[block_id]
        assert block.hash == h
        assert list(executor.kv[block_id * bs:(block_id + 1) * bs]) == block.token_ids, "a hash names stale KV"
    assert all(block_id in bm.hash_to_block_ids.get(h, ()) for h, block_id in bm.named.items()), \
        "nano-vLLM's name for a prefix is not one of its registered copies"
    for seq in engine.scheduler.running:
        if not seq.verifying and seq.block_table and len(seq.token_ids) - 1 == seq.num_cached_tokens \
                and engine.config.speculative and engine.config.num_scheduler_steps == 1:
            assert len(seq.block_table) == -(-seq.num_cached_tokens // bs), "a rejected proposal's block is held"


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
@pytest.mark.parametrize(("overlap", "num_steps", "ahead", "queued"),
                         [(False, 1, 0, False), (False, 1, 1, False), (True, 1, 0, False), (True, 1, 1, False),
                          (True, 1, 2, False), (False, 5, 0, False), (False, 5, 1, False), (True, 3, 2, False),
                          (True, 1, 2, True), (True, 3, 2, True)],
                         ids=["sync", "sync-ahead", "overlap", "overlap-ahead", "overlap-two-ahead", "multi-step",
                              "multi-step-ahead", "multi-step-overlap-two-ahead", "overlap-two-ahead-queued",
                              "multi-step-overlap-two-ahead-queued"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
# Ten sequences verifying n-gram proposals take 20 tokens of a budget of 8: the mixed policy once scheduled a prompt's
# chunk of -1 tokens in what was left.
@example((4, 10, 8, 10, [[1]], [(0, [1], 1, False, 2, 0), *[(0, [1], 3, False, 0, 0)] * 4,
                                 *[(0, [1], 2, False, 0, 0)] * 4, (0, [2], 2, False, 0, 0)], ("ngram", 1, 1), "fcfs"))
# Two plans ahead: a sequence preempted while both still owed it a token waited at the head of ``waiting`` with none
# running, and the schedule of the next plan said no sequence could ever fit.
@example((8, 9, 8, 2, [[1, 1, 1, 1]], [(0, [1], 5, False, 0, 0), (0, [1], 21, False, 1, 0),
                                      (0, [1] * 11 + [2], 26, False, 0, 0)], (None, 1, 1), "fcfs"))
def test_engine_matches_sequential_reference(overlap, num_steps, ahead, queued, policy, workload):
    """Under either policy, in arrival or priority order: mixed steps (decodes beside prefill chunks, prefix hits, one
    chunked prompt, preemption), with speculation on or off, give every request the sequential reference's tokens;
    rejected proposals leave no slot, block or hash behind. ``ahead``: after each step up to that many next plans are
    launched before anything else, as the engine loop does when the outputs cannot change them
    (``Engine.launch_ahead``), unless a request arrives next. ``queued``: the executor queues each step as a GPU does,
    the next launched behind it."""
    block_size, num_blocks, budget, max_num_seqs, prefixes, requests, (speculation, k, miss_every), order = workload
    executor = ShadowExecutor(num_blocks, block_size, VOCAB, (EOS,), max_model_len=4096,
                              draft_miss_every=miss_every if speculation == "draft" else None, queues=queued)
    ngram = dict(ngram_min=1, ngram_max=3) if speculation == "ngram" else {}
    # Proposals at every batch size (the shadow says it runs on a CPU, where they would stop above a few).
    unbounded = dict(speculative_disable_by_batch_size=1 << 16) if speculation else {}
    config = SchedulerConfig(max_num_seqs, budget, num_steps, policy, speculative=speculation,
                             num_speculative_tokens=k if speculation else None, **ngram, **unbounded,
                             request_order=order)
    engine = Engine(executor, config, overlap=overlap, plans_ahead=max(ahead, 1))
    pending = []
    for prefix_choice, tail, max_tokens, ignore_eos, arrival, priority in requests:
        prompt = (prefixes[prefix_choice] if prefix_choice < len(prefixes) else []) + tail
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        fits = max(len(prompt), len(prompt) + max_tokens - 1) <= num_blocks * block_size
        if fits:
            pending.append((arrival, prompt, params, priority if order == "priority" else 0))
    submitted = []
    step = 0
    while pending or engine.has_unfinished():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            submitted.append((item[1], item[2], engine.add_request(item[1], item[2], priority=item[3])))
        engine.step()
        check_invariants(engine, executor)
        step += 1
        if ahead and not any(p[0] <= step for p in pending):
            engine.launch_ahead()
        assert step < MAX_STEPS, f"no progress after {step} steps: {len(engine.scheduler.waiting)} waiting, " \
            f"{len(engine.scheduler.running)} running"
    engine.step()
    for prompt, params, seq in submitted:
        assert seq.is_finished
        assert seq.completion_token_ids == expected(engine, prompt, params)
    assert_all_blocks_free(engine.block_manager)
    assert len(executor.table) == 0
