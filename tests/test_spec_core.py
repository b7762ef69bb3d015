"""Speculative decoding in the executor's core, on the shadow-KV executor: plans with proposals are checked whole,
verified (accepted prefix, then the executor's own token), recorded, and each request's block table cut to its
computed tokens; the draft-model path gives the tokens of plain decoding."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from common.step import CachedRequests, StepPlan
from executor_svc.core.request_table import INVALID, PRECONDITION, PlanError
from executor_svc.fakes.shadow import EMPTY_SLOT, ShadowExecutor, reference_generate
from tests.spec_helpers import SpecDriver

VOCAB = 50
PROMPT = [3, 1, 4, 1, 5, 9, 2]  # 7 tokens: with block size 4 the first completion token opens block 1


def shadow(**kwargs: object) -> ShadowExecutor:
    return ShadowExecutor(num_blocks=32, block_size=4, vocab_size=VOCAB, eos_token_ids=(), **kwargs)


def truth(n: int, prompt: list[int] = PROMPT) -> list[int]:
    return reference_generate(prompt, n, VOCAB)


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_a_verification_gives_the_accepted_proposals_then_its_own_token(accepted: int) -> None:
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})
    expected = truth(5)
    proposals = expected[1:1 + accepted] + [wrong(t) for t in expected[1 + accepted:4]]
    result = driver.decode({1: proposals})
    assert result.num_sampled_tokens == [accepted + 1]
    assert result.token_ids == expected[1:2 + accepted]
    state = driver.executor.table.requests[1]
    assert state.token_ids == PROMPT + expected[:2 + accepted]
    assert state.num_computed_tokens == len(PROMPT) + 1 + accepted
    assert state.block_table == driver.requests[1].block_table
    assert len(state.block_table) == -(-state.num_computed_tokens // 4)


def test_generation_with_proposals_equals_plain_decoding_whatever_they_are() -> None:
    """Proposals right, wrong and mixed, across block boundaries and rows without proposals in the same step."""
    reference = {rid: reference_generate(PROMPT + [rid], 20, VOCAB) for rid in (1, 2, 3)}
    rng = np.random.default_rng(0)

    def propose(rid: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(PROMPT) - 1
        k = int(rng.integers(0, 5))
        return [t if rng.random() < 0.7 else wrong(t) for t in reference[rid][done:done + k]] + [7] * max(
            0, k - len(reference[rid][done:done + k]))

    driver = SpecDriver(shadow())
    out = driver.generate({rid: PROMPT + [rid] for rid in reference}, 20, propose)
    assert out == reference
    assert any(n > 1 for r in driver.results for n in r.num_sampled_tokens), "no proposal was ever accepted"
    driver.finish()
    assert len(driver.executor.table) == 0


def test_the_draft_model_path_gives_the_tokens_of_plain_decoding() -> None:
    executor = shadow(draft_miss_every=3)
    assert executor.get_info().draft_model_id
    driver = SpecDriver(executor)
    out = driver.generate({1: PROMPT, 2: PROMPT[::-1]}, 24, lambda rid, tokens: 3)
    assert out == {1: truth(24), 2: truth(24, PROMPT[::-1])}
    counts = [n for r in driver.results[1:] for n in r.num_sampled_tokens]
    assert max(counts) == 4 and min(counts) < 4, "the draft should be right some times and wrong others"


def test_rejected_proposals_leave_their_slots_empty() -> None:
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})
    expected = truth(4)
    driver.decode({1: [expected[1], wrong(expected[2]), 5]})
    executor = driver.executor
    state = executor.table.requests[1]
    slots = executor._slots(state.block_table, 0, state.num_computed_tokens)
    assert list(executor.kv[slots]) == PROMPT + expected[:2]
    # Positions 9 and 10 held the rejected proposals; block 2 (positions 8..11) is kept for position 8.
    assert list(executor.kv[executor._slots(state.block_table, 9, 12)]) == [EMPTY_SLOT] * 3


def test_a_cut_table_grows_again_from_the_next_plan() -> None:
    """All proposals rejected after reserving two new blocks: both go, and the next plan appends others."""
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})  # 8 tokens, 7 computed: blocks 0, 1
    expected = truth(10)
    driver.decode({1: [wrong(t) for t in expected[1:9]]})  # reserves up to position 15: 4 blocks
    state = driver.executor.table.requests[1]
    assert state.num_computed_tokens == 8 and len(state.block_table) == 2
    driver.decode({1: expected[2:6]})
    assert driver.requests[1].completion == expected[:7]
    assert state.block_table == driver.requests[1].block_table


def verification_plan(request_id: int = 1, computed: int = 7, scheduled: int = 3, drafts: list[int] | None = None,
                      counts: list[int] | None = None, new_blocks: list[int] = (), **extra: list[int]) -> StepPlan:
    return StepPlan(cached_requests=CachedRequests(
        [request_id], [computed], [scheduled], [len(new_blocks)], list(new_blocks),
        num_draft_tokens=[2] if counts is None else counts, draft_token_ids=[5, 6] if drafts is None else drafts,
        **extra))


@pytest.mark.parametrize(("plan", "code", "message"), [
    (verification_plan(scheduled=2), INVALID, "verifying 2 proposals schedules its last token and them"),
    (verification_plan(computed=6, scheduled=3), INVALID, "verifying 2 proposals"),
    (verification_plan(counts=[2, 1]), INVALID, "one entry per cached request"),
    (verification_plan(drafts=[5]), INVALID, "draft_token_ids has 1 ids, num_draft_tokens sums to 2"),
    (verification_plan(drafts=[5, VOCAB]), INVALID, "outside the vocabulary"),
    (verification_plan(drafts=[]), PRECONDITION, "this executor has none"),
    (verification_plan(num_decode_steps=[1]), INVALID, "not both"),
    (verification_plan(counts=[4], drafts=[1, 2, 3, 4], scheduled=5), INVALID, "blocks hold 8 tokens, 12 needed"),
    (verification_plan(new_blocks=[99]), INVALID, "block id 99 is out of range"),
])
def test_a_bad_verification_plan_is_refused_and_changes_nothing(plan: StepPlan, code: str, message: str) -> None:
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})
    executor = driver.executor
    before = copy.deepcopy(executor.table.requests)
    with pytest.raises(PlanError, match=message) as err:
        executor.step(plan)
    assert err.value.code == code
    assert executor.table.requests == before
    driver.decode({1: truth(4)[1:3]})  # and it goes on as if nothing was sent
    assert driver.requests[1].completion == truth(4)


def test_an_executor_that_does_not_verify_refuses_proposals() -> None:
    executor = shadow()
    executor.table.verifies_drafts = False
    driver = SpecDriver(executor)
    driver.prefill({1: PROMPT})
    with pytest.raises(PlanError, match="does not verify") as err:
        executor.step(verification_plan())
    assert err.value.code == PRECONDITION


def test_a_plan_naming_a_request_under_verification_waits_for_its_tokens() -> None:
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})
    executor = driver.executor
    prepared = executor.prepare(verification_plan(new_blocks=[9]))
    with pytest.raises(PlanError, match="verification step before has not returned") as err:
        executor.prepare(verification_plan(computed=8, new_blocks=[10]))
    assert err.value.code == PRECONDITION
    result = executor.execute(prepared)
    assert len(result.token_ids) == result.num_sampled_tokens[0]


def test_a_plan_without_proposals_has_no_sample_counts() -> None:
    """Counts come only with proposals: a plan whose counts are all 0 is a plain decode step."""
    driver = SpecDriver(shadow())
    driver.prefill({1: PROMPT})
    result = driver.decode({1: []})
    assert result.num_sampled_tokens == [] and result.token_ids == truth(2)[1:]
    assert driver.results[0].num_sampled_tokens == []
    driver.finish()
