"""Speculative decoding in the scheduler core: the n-gram proposer, booking and give-back of proposals' slots and
blocks, budgets, stops mid-proposal and the back-off, against a model-free verifier (``tests.spec_helpers``)."""

from __future__ import annotations

import pytest

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.mixed import POLICIES
from scheduler_svc.core.ngram import NgramIndex
from scheduler_svc.core.planner import Planner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import PENDING, FinishReason, Sequence
from tests.conftest import EOS, assert_all_blocks_free
from tests.spec_oracle import reference, run_all, run_step

_ids = iter(range(10**9))


def make(speculative: str | None = "ngram", num_blocks: int = 64, block_size: int = 4, k: int = 3,
         policy: str = "nano-vllm", **config) -> Scheduler:
    config.setdefault("ngram_min", 1 if speculative == "ngram" else None)
    config.setdefault("ngram_max", 3 if speculative == "ngram" else None)
    cfg = SchedulerConfig(policy=policy, speculative=speculative, num_speculative_tokens=k, **config)
    return POLICIES[policy](cfg, BlockManager(num_blocks, block_size), {EOS}, 4096)


def add(scheduler: Scheduler, prompt: list[int], max_tokens: int = 24, **params) -> Sequence:
    seq = Sequence(next(_ids), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                      **params), scheduler.block_size)
    scheduler.add(seq)
    return seq


def prefill(scheduler: Scheduler, planner: Planner, token: int) -> None:
    """Run the prefill of everything waiting, sampling ``token`` for each."""
    seqs, is_prefill = scheduler.schedule()
    assert is_prefill
    plan, ordered = planner.build(seqs, True, [])
    scheduler.settle(scheduler.advance(ordered, True), [token] * len(seqs))


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12, 13]]


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 7, 1, 2, 3]
    # "1 2 3" last occurred at 4..6, followed by 4 7; the earlier occurrence (followed by 9) is older.
    assert index.propose(tokens, len(tokens), 2) == [4, 7]
    tokens += [4, 8]  # "4 8" is new, but its 1-gram "8" is not; "4" alone was followed by 7 and 8 (latest: 8)
    assert index.propose(tokens, len(tokens), 3) == []
    tokens.append(4)
    assert index.propose(tokens, len(tokens), 1) == [8]


def test_ngram_index_continues_a_repeat_past_the_end_and_ignores_placeholders() -> None:
    index = NgramIndex(2, 2)
    tokens = [5, 6, 5, 6]
    assert index.propose(tokens, 4, 5) == [5, 6, 5, 6, 5]
    assert index.propose([7, 8, 9, PENDING], 3, 2) == []
    assert not index.matches([7, 8, 9], 3)


def test_ngram_index_is_incremental() -> None:
    """Each token is indexed once however often the sequence proposes: a step's cost does not grow with length."""
    index = NgramIndex(1, 2)
    tokens = list(range(100))
    index.propose(tokens, 100, 4)
    assert index.indexed == 100 and len(index.positions) == 99 + 98
    tokens.append(0)
    assert index.propose(tokens, 101, 4) == [1, 2, 3, 4]
    assert index.indexed == 101


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_outputs_equal_sequential_reference_and_every_block_comes_back(policy: str, k: int) -> None:
    scheduler = make(k=k, policy=policy, max_num_batched_tokens=16)
    seqs = [add(scheduler, p) for p in PROMPTS]
    run_all(scheduler)
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.completion_token_ids == reference(prompt, 24)
    counters = scheduler.speculator.counters
    assert counters.num_accepted_tokens > 0 and counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.accepted_per_position[0] >= counters.accepted_per_position[-1]
    assert_all_blocks_free(scheduler.block_manager)


def test_preemption_and_small_cache_keep_outputs_exact() -> None:
    scheduler = make(num_blocks=14, k=4)
    seqs = [add(scheduler, p, max_tokens=20) for p in PROMPTS]
    run_all(scheduler)
    assert scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.completion_token_ids == reference(prompt, 20)
    assert_all_blocks_free(scheduler.block_manager)


def test_verification_row_books_its_proposals_and_gives_back_the_rejected() -> None:
    scheduler, planner = make(k=4), Planner()
    seq = add(scheduler, [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=12)
    run_step(scheduler, planner)  # prefill: 9 tokens, "3" sampled? whatever it is, the prompt repeats "1 2 3"
    seqs, is_prefill = scheduler.schedule()
    assert not is_prefill and seqs == [seq]
    k = seq.num_draft_tokens
    assert k > 0 and seq.num_scheduled_tokens == 1 + k
    assert len(seq.block_table) * 4 >= len(seq.token_ids) + k  # KV for the last token and every proposal
    plan, ordered = planner.build(seqs, False, [])
    assert plan.cached_requests.num_draft_tokens == [k] and len(plan.cached_requests.draft_token_ids) == k
    assert not plan.cached_requests.num_decode_steps
    start = seq.num_cached_tokens
    record = scheduler.advance(ordered, False)
    assert seq.verifying and seq.token_ids[-(k + 1):] == [PENDING] * (k + 1)
    assert scheduler.schedule() == ([], False)  # held until its result
    free_before = scheduler.block_manager.num_free_blocks
    scheduler.settle(record, [7], (), None, [1])  # every proposal rejected: only the executor's own token
    planner.tables_cut([seq])
    assert seq.num_cached_tokens == start + 1 and seq.token_ids[-1] == 7 and PENDING not in seq.token_ids
    assert len(seq.block_table) == -(-seq.num_cached_tokens // 4)
    assert scheduler.block_manager.num_free_blocks >= free_before
    assert planner.num_blocks_sent[seq.seq_id] == len(seq.block_table)
    assert not seq.verifying
    run_all(scheduler, planner)
    assert_all_blocks_free(scheduler.block_manager)


def test_hashes_are_registered_only_for_blocks_of_accepted_tokens() -> None:
    scheduler = make(k=6, block_size=2)
    seqs = [add(scheduler, p, max_tokens=30) for p in PROMPTS[:2]]
    planner = Planner()
    while not scheduler.is_finished():
        run_step(scheduler, planner)
        for seq in scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                block = scheduler.block_manager.blocks[block_id]
                if block.token_ids:
                    assert block.token_ids == seq.block(i) and (i + 1) * 2 <= seq.num_cached_tokens
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in seqs)
    assert_all_blocks_free(scheduler.block_manager)


def test_proposals_share_the_token_budget_and_leave_each_sequence_a_token() -> None:
    scheduler, planner = make(k=6, max_num_batched_tokens=6), Planner()
    seqs = [add(scheduler, p) for p in PROMPTS]
    seen = []

    def check(step: list[Sequence], is_prefill: bool) -> None:
        if not is_prefill:
            assert all(seq.num_scheduled_tokens == 1 + seq.num_draft_tokens for seq in step)
            # Every running sequence keeps one token of the budget; the proposals share the rest.
            assert sum(seq.num_draft_tokens for seq in step) <= 6 - len(scheduler.running)
            seen.append(sum(seq.num_draft_tokens for seq in step))

    while not scheduler.is_finished():
        run_step(scheduler, planner, check)
    assert max(seen) > 0
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.completion_token_ids == reference(prompt, 24)
    assert_all_blocks_free(scheduler.block_manager)


def test_proposals_take_only_the_blocks_left_once_every_row_has_its_own() -> None:
    # One block free after the prefill: a's proposals must not take it from b, whose own next token starts a block,
    # which would preempt c.
    scheduler = make(k=4, num_blocks=7, ngram_min=2, ngram_max=2)
    a = add(scheduler, [1, 2, 1, 2, 1, 2, 1], max_tokens=8)
    b = add(scheduler, [7, 3, 8, 9, 4, 6, 10, 11], max_tokens=3)
    c = add(scheduler, [13, 14, 15, 16, 17, 18, 19], max_tokens=3)
    planner = Planner()
    prefill(scheduler, planner, 2)  # a: 1 2 1 2 1 2 1 2 (proposes 1 2 ...), b: 9 tokens, c: 8 tokens
    assert scheduler.block_manager.num_free_blocks == 1
    seqs, _ = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and seqs == [a, b, c]
    assert a.num_draft_tokens == 0, "no block was left for a's proposals"
    run_all(scheduler, planner)
    for seq in (a, b, c):
        assert seq.is_finished
    assert_all_blocks_free(scheduler.block_manager)


def test_under_the_mixed_policy_proposals_leave_a_waiting_prompt_half_the_budget() -> None:
    # Two decodes with repeats to propose from, 10 tokens a step: their proposals could fill the budget every step
    # and leave the waiting prompt none; they leave it half of the 8 the decodes leave.
    scheduler = make(policy="mixed", k=4, max_num_batched_tokens=10)
    a, b = add(scheduler, [1, 2, 1, 2, 1]), add(scheduler, [5, 2, 5, 2, 5])  # each repeats once 2 is sampled
    planner = Planner()
    prefill(scheduler, planner, 2)
    waiting = add(scheduler, [20, 21, 22, 23, 24, 25, 26, 27])
    steps = []
    run_step(scheduler, planner, lambda seqs, _: steps.append((seqs, waiting.num_scheduled_tokens)))
    assert steps == [([a, b, waiting], (10 - 2) // 2)], "the prompt waited behind the proposals"
    run_all(scheduler, planner)
    assert_all_blocks_free(scheduler.block_manager)


def test_proposals_never_pass_max_tokens_nor_preempt() -> None:
    scheduler = make(k=6, num_blocks=8)
    a = add(scheduler, [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2], max_tokens=3)
    b = add(scheduler, [4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5], max_tokens=14)
    planner = Planner()
    run_step(scheduler, planner)
    seqs, _ = scheduler.schedule()
    # a samples 3 tokens at most: one is out, so it proposes at most one; b proposes only what the free blocks hold.
    assert a.num_draft_tokens <= 1
    assert scheduler.num_preemptions == 0 and len(seqs) == 2
    # Each holds 13 tokens (4 blocks) with a's one proposal in its 4th block: all 8 blocks taken, none overbooked.
    assert len(a.block_table) == len(b.block_table) == 4 and scheduler.block_manager.num_free_blocks == 0
    plan, ordered = planner.build(seqs, False, [])
    record = scheduler.advance(ordered, False)
    scheduler.settle(record, [3] * (2 + sum(record.drafts or [0])), (), None,
                     [1 + k for k in record.drafts] if record.drafts else None)
    run_all(scheduler, planner)
    assert a.num_completion_tokens == 3 and b.num_completion_tokens == 14
    assert_all_blocks_free(scheduler.block_manager)


def test_eos_among_accepted_proposals_ends_the_sequence_there() -> None:
    scheduler, planner = make(k=4), Planner()
    seq = Sequence(next(_ids), [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=20),
                   scheduler.block_size)
    scheduler.add(seq)
    run_step(scheduler, planner)
    seqs, _ = scheduler.schedule()
    k = seq.num_draft_tokens
    assert k >= 2
    plan, ordered = planner.build(seqs, False, [])
    proposals = plan.cached_requests.draft_token_ids
    record = scheduler.advance(ordered, False)
    # The executor accepts the first proposal, then samples EOS where the second stood (its own token).
    outputs = scheduler.settle(record, [proposals[0], EOS], (), None, [2])
    assert seq.finish_reason is FinishReason.STOP and seq.completion_token_ids[-2:] == [proposals[0], EOS]
    assert outputs[0].final and not seq.block_table
    run_all(scheduler, planner)
    assert_all_blocks_free(scheduler.block_manager)


def test_stop_token_in_the_middle_of_accepted_tokens_drops_the_rest() -> None:
    scheduler, planner = make(k=4), Planner()
    seq = add(scheduler, [1, 2, 3, 4, 1, 2, 3, 4, 1], max_tokens=20, stop_token_ids=[4])
    prefill(scheduler, planner, 2)
    scheduler.schedule()
    assert seq.num_draft_tokens == 4
    plan, ordered = planner.build([seq], False, [])
    proposals = plan.cached_requests.draft_token_ids  # "3 4 1 2": the second is the stop token
    assert proposals == [3, 4, 1, 2]
    record = scheduler.advance(ordered, False)
    sampled = [*proposals, 9]  # all accepted: the stop rule still ends it at the stop token
    outputs = scheduler.settle(record, sampled, (), None, [len(sampled)])
    assert outputs[0].token_ids == [3, 4] and seq.completion_token_ids == [2, 3, 4]
    assert seq.finish_reason is FinishReason.STOP and not seq.block_table
    assert_all_blocks_free(scheduler.block_manager)


def test_back_off_stops_proposing_after_misses_and_grows_after_hits() -> None:
    scheduler, planner = make(k=3), Planner()
    seq = add(scheduler, [1, 2, 1, 2, 1, 2, 1], max_tokens=40)
    prefill(scheduler, planner, 2)
    state = seq.speculation
    for expected_skip in (8, 16):
        seqs, _ = scheduler.schedule()
        assert seq.num_draft_tokens > 0
        plan, ordered = planner.build(seqs, False, [])
        record = scheduler.advance(ordered, False)
        scheduler.settle(record, [30], (), None, [1])  # nothing accepted
        planner.tables_cut([seq])
        assert state.skip_until == seq.num_completion_tokens + expected_skip
        for _ in range(expected_skip):  # it decodes plainly while it waits
            seqs, _ = scheduler.schedule()
            assert seq.num_draft_tokens == 0
            plan, ordered = planner.build(seqs, False, [])
            scheduler.settle(scheduler.advance(ordered, False), [30])
    seqs, _ = scheduler.schedule()  # "30 30 30": the proposer matches again and proposes after its wait
    assert seq.num_draft_tokens == 1  # a probe of one proposal after a miss
    plan, ordered = planner.build(seqs, False, [])
    record = scheduler.advance(ordered, False)
    scheduler.settle(record, [*plan.cached_requests.draft_token_ids, 31], (), None, [2])
    planner.tables_cut([seq])
    assert state.misses == 0 and state.draft_len == 2  # all accepted: one more next time
    run_all(scheduler, planner)
    assert_all_blocks_free(scheduler.block_manager)


@pytest.mark.parametrize("params", [dict(prompt_logprobs=1), dict(n=2)])
def test_requests_that_cannot_gain_never_propose(params: dict) -> None:
    scheduler = make(k=3)
    seq = add(scheduler, [1, 2, 1, 2, 1, 2, 1], max_tokens=12, **params)
    run_all(scheduler)
    assert seq.speculation is None and scheduler.speculator.counters.num_drafts == 0
    assert_all_blocks_free(scheduler.block_manager)


def test_a_sequence_marked_not_to_speculate_never_proposes() -> None:
    scheduler = make(k=3)
    seq = Sequence(next(_ids), [1, 2, 1, 2, 1, 2, 1], SamplingParams(temperature=0, max_tokens=12), 4)
    seq.speculate = False  # a choice of n > 1 after the first
    scheduler.add(seq)
    run_all(scheduler)
    assert scheduler.speculator.counters.num_drafts == 0
    assert_all_blocks_free(scheduler.block_manager)


def test_no_proposals_above_the_batch_size_limit() -> None:
    scheduler = make(k=3, speculative_disable_by_batch_size=1)
    for p in PROMPTS[:2]:
        add(scheduler, [*p, *p], max_tokens=6 if p is PROMPTS[0] else 30)
    run_all(scheduler)
    assert scheduler.speculator.counters.num_drafts > 0  # once one finished, the other proposes
    assert_all_blocks_free(scheduler.block_manager)
    scheduler2 = make(k=3, speculative_disable_by_batch_size=1)
    for p in PROMPTS[:2]:
        add(scheduler2, [*p, *p], max_tokens=1)
    run_all(scheduler2)
    assert scheduler2.speculator.counters.num_drafts == 0
    assert_all_blocks_free(scheduler2.block_manager)


def test_mixed_step_has_verification_rows_beside_a_prefill_chunk() -> None:
    scheduler, planner = make(k=3, policy="mixed", max_num_batched_tokens=10), Planner()
    a = add(scheduler, [1, 2, 1, 2, 1, 2, 1], max_tokens=30)
    prefill(scheduler, planner, 2)
    b = add(scheduler, list(range(20, 40)), max_tokens=4)
    steps = []

    def check(step: list[Sequence], is_prefill: bool) -> None:
        if a in step and b in step and a.num_draft_tokens and b.num_cached_tokens < b.num_prompt_tokens:
            assert is_prefill and b.num_scheduled_tokens <= 10 - 1 - a.num_draft_tokens
            steps.append(step)

    while not scheduler.is_finished():
        run_step(scheduler, planner, check)
    assert steps
    assert a.completion_token_ids[1:] == reference([1, 2, 1, 2, 1, 2, 1, 2], 29)
    assert b.completion_token_ids == reference(list(range(20, 40)), 4)
    assert_all_blocks_free(scheduler.block_manager)


def test_held_in_flight_decodes_wait_when_a_sequence_would_propose() -> None:
    """Overlap: a plan booked while a decode is in flight proposes nothing; where a sequence's settled tokens
    already match, every decode in flight waits instead, so the batch stays one step."""
    scheduler, planner = make(k=3), Planner()
    a = add(scheduler, [1, 2, 1, 2, 1, 2, 1], max_tokens=12)
    b = add(scheduler, [30, 31, 32, 33], max_tokens=12)
    prefill(scheduler, planner, 2)
    seqs, _ = scheduler.schedule()
    a_drafts = a.num_draft_tokens
    plan, ordered = planner.build(seqs, False, [])
    record = scheduler.advance(ordered, False)
    assert a_drafts > 0 and a.verifying
    assert scheduler.schedule() == ([], False)  # a verifies, so b waits with it
    n = [1 + a_drafts if s is a else 1 for s in record.seqs]
    tokens = []
    for s, count in zip(record.seqs, n, strict=True):
        tokens += ([*plan.cached_requests.draft_token_ids, 1] if s is a else [40])[:count]
    scheduler.settle(record, tokens, (), None, n)
    planner.tables_cut([a])
    run_all(scheduler, planner)
    assert b.num_completion_tokens == 12
    assert_all_blocks_free(scheduler.block_manager)


def test_one_sequence_a_step_keeps_each_plans_proposals_consistent() -> None:
    """max_num_seqs 1: each step proposes for the running sequences but schedules one; every plan's proposal ids
    add up to its counts (the oracle checks) and outputs stay exact."""
    scheduler = make(k=3, max_num_seqs=1)
    seqs = [add(scheduler, p, max_tokens=12) for p in PROMPTS[:3]]
    run_all(scheduler)
    for seq, prompt in zip(seqs, PROMPTS, strict=False):
        assert seq.completion_token_ids == reference(prompt, 12)
    assert scheduler.speculator.counters.num_drafts > 0
    assert_all_blocks_free(scheduler.block_manager)
