"""The sampler against the definitions of greedy, temperature, top-k, top-p, min-p, seeds and logprobs.

Distribution tests draw many rows from a small known distribution with fixed
seeds, so they are deterministic; the frequency tolerance is five standard
deviations wide besides.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from common.step import SamplingSettings
from executor_svc.sample.sampler import NUCLEUS_WINDOW, TIE_MARGIN, Sampler, filtered_probs

# Ids deliberately not in rank order: ranked, the ids are 3, 1, 5, 2, 4, 0.
PROBS = [0.04, 0.25, 0.10, 0.40, 0.06, 0.15]
LOGITS = torch.tensor(PROBS).log()
VOCAB = len(PROBS)
DRAWS = 20_000


def draw(logits: torch.Tensor, params: SamplingSettings, n: int = DRAWS) -> list[int]:
    """``n`` unseeded draws of one row's distribution, made as one batch of identical rows."""
    return Sampler(seed=0)(logits.expand(n, -1), [params] * n, [0] * n).token_ids


def restricted(weights: list[float], allowed: set[int]) -> list[float]:
    """``weights`` zeroed outside ``allowed`` and renormalised."""
    kept = [w if i in allowed else 0.0 for i, w in enumerate(weights)]
    return [w / sum(kept) for w in kept]


def assert_follows(tokens: list[int], expected: list[float]) -> None:
    """The tokens drawn are exactly the support of ``expected``, at its frequencies within five standard deviations."""
    assert set(tokens) == {i for i, p in enumerate(expected) if p > 0}
    frequencies = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double() / len(tokens)
    tolerance = 5 * 0.5 / math.sqrt(len(tokens))
    assert torch.allclose(frequencies, torch.tensor(expected, dtype=torch.double), atol=tolerance), frequencies


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[2, [5, 40, 77]] = 50.0
    greedy = SamplingSettings(temperature=0.0)
    tokens = Sampler(seed=0)(logits, [greedy] * 8, list(range(8))).token_ids
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[2] == 5


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    logits[4, [9, 60]] = 50.0
    greedy, sampled = SamplingSettings(temperature=0.0), SamplingSettings(temperature=1.5, top_p=0.9)
    params = [greedy, sampled, greedy, sampled, greedy, SamplingSettings(temperature=1e-40, num_logprobs=2)]
    tokens = Sampler(seed=0)(logits, params, [3] * 6).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 4, 5)] == [argmax[i] for i in (0, 2, 4, 5)]
    assert tokens[4] == 9


def test_greedy_batch_draws_no_randomness() -> None:
    logits = torch.zeros(16, 1000)
    unseeded = [SamplingSettings()] * 16
    used = Sampler(seed=3)
    used(logits, [SamplingSettings(temperature=0.0)] * 16, [0] * 16)
    assert used(logits, unseeded, [0] * 16).token_ids == Sampler(seed=3)(logits, unseeded, [0] * 16).token_ids


def test_default_params_sample_the_softmax() -> None:
    assert_follows(draw(LOGITS, SamplingSettings()), PROBS)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingSettings(top_k=3), {3, 1, 5}),
        (SamplingSettings(top_k=1), {3}),
        (SamplingSettings(top_k=100), set(range(VOCAB))),
        (SamplingSettings(top_k=0), set(range(VOCAB))),
        # Cumulative mass by rank: 0.40, 0.65, 0.80, 0.90, 0.96, 1.00.
        (SamplingSettings(top_p=0.6), {3, 1}),
        (SamplingSettings(top_p=0.3), {3}),
        (SamplingSettings(top_p=0.7), {3, 1, 5}),
        (SamplingSettings(top_p=1.0), set(range(VOCAB))),
        # min_p x 0.40 is the threshold.
        (SamplingSettings(min_p=0.3), {3, 1, 5}),
        (SamplingSettings(min_p=0.2), {3, 1, 5, 2}),
        (SamplingSettings(min_p=1.0), {3}),
        (SamplingSettings(min_p=0.0), set(range(VOCAB))),
        # Top-p sees the top-k survivors renormalised: 0.44, 0.72, 0.89, 1.00.
        (SamplingSettings(top_k=4, top_p=0.85), {3, 1, 5}),
        # Min-p before top-p (vLLM's order): min-p 0.2 keeps 4, renormalised 0.44, 0.72, 0.89, 1.00 by rank, of
        # which top-p 0.85 keeps 3 (top-p first would have kept 4).
        (SamplingSettings(top_p=0.85, min_p=0.2), {3, 1, 5}),
        (SamplingSettings(top_k=5, top_p=0.95, min_p=0.3), {3, 1, 5}),
        # Min-p 0.5 keeps 0.40 and 0.25, of which top-p 0.6 keeps the first (0.62 of their mass); top-p first
        # (Hugging Face's order) would have kept both.
        (SamplingSettings(top_p=0.6, min_p=0.5), {3}),
    ],
)
def test_filters_keep_their_defined_set(params: SamplingSettings, allowed: set[int]) -> None:
    assert_follows(draw(LOGITS, params), restricted(PROBS, allowed))


def test_top_k_keeps_the_tokens_tied_with_its_kth_as_hugging_face_and_vllm_do() -> None:
    weights = [0.1, 0.4, 0.2, 0.05, 0.2, 0.05]  # ranked 1, then 2 and 4 tied, then 0
    logits = torch.tensor(weights).log()
    assert_follows(draw(logits, SamplingSettings(top_k=2)), restricted(weights, {1, 2, 4}))
    assert_follows(draw(logits, SamplingSettings(top_k=2, top_p=0.9)), restricted(weights, {1, 2, 4}))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_or_flattens(temperature: float) -> None:
    scaled = [p ** (1 / temperature) for p in PROBS]
    expected = [w / sum(scaled) for w in scaled]
    assert_follows(draw(LOGITS, SamplingSettings(temperature=temperature)), expected)


def test_top_k_keeps_ties_past_its_kth_up_to_its_margin() -> None:
    tokens = draw(torch.zeros(100), SamplingSettings(top_k=2))
    assert_follows(tokens, restricted([1.0] * 100, set(tokens)))
    assert len(set(tokens)) == 2 + TIE_MARGIN, "more ties than the margin are cut, not ranked on the whole vocabulary"


UNRANKED_CASES = [
    (SamplingSettings(min_p=0.2, seed=4), {3, 1, 5, 2}),
    (SamplingSettings(temperature=0.0), {3}),
    (SamplingSettings(), set(range(VOCAB))),
]


@pytest.mark.parametrize(
    "ranked_cases",
    [
        # A row with top-p but no top-k makes the whole vocabulary ranked.
        [
            (SamplingSettings(top_k=3), {3, 1, 5}),
            (SamplingSettings(top_p=0.6), {3, 1}),
            (SamplingSettings(top_k=4, top_p=0.85), {3, 1, 5}),
        ],
        # Every ranked row has a top-k, so only the best 5 are ranked; top-5 mass: 0.42, 0.68, 0.83, ...
        [
            (SamplingSettings(top_k=3), {3, 1, 5}),
            (SamplingSettings(top_k=1, top_p=0.9), {3}),
            (SamplingSettings(top_k=5, top_p=0.6), {3, 1}),
        ],
    ],
)
def test_rows_with_different_filters_share_a_batch(ranked_cases: list[tuple[SamplingSettings, set[int]]]) -> None:
    cases = ranked_cases + UNRANKED_CASES
    params = [case for case, _ in cases] * (DRAWS // len(cases))
    tokens = Sampler(seed=0)(LOGITS.expand(len(params), -1), params, list(range(len(params)))).token_ids
    for i, (_, allowed) in enumerate(cases):
        assert_follows(tokens[i :: len(cases)], restricted(PROBS, allowed))


def test_filters_apply_after_temperature() -> None:
    # At temperature 0.5 the ranked mass is 0.615, 0.855, ...; top-p 0.75 keeps 2 (at 1.0 it would keep 3).
    scaled = [p**2 for p in PROBS]
    expected = restricted(scaled, {3, 1})
    assert_follows(draw(LOGITS, SamplingSettings(temperature=0.5, top_p=0.75)), expected)


def reference_probs(logits: torch.Tensor, row: SamplingSettings) -> torch.Tensor:
    """The filter definitions applied one token at a time, in float64."""
    probs = (logits.double() / row.temperature).softmax(dim=-1)
    ranked = [i for i in probs.argsort(descending=True).tolist() if probs[i] >= row.min_p * probs.max()]
    kept = [i for i in ranked if probs[i] >= probs[ranked[min(row.top_k, len(ranked)) - 1]]] if row.top_k else ranked
    mass, total, allowed = 0.0, sum(probs[i].item() for i in kept), []
    for i in kept:
        if allowed and mass >= row.top_p * total:
            break
        allowed.append(i)
        mass += probs[i].item()
    out = torch.zeros_like(probs)
    out[allowed] = probs[allowed] / probs[allowed].sum()
    return out


LARGE_VOCAB_CASES = [
    SamplingSettings(top_p=0.5),
    SamplingSettings(temperature=3.0, top_p=0.99),
    SamplingSettings(top_k=2000, top_p=0.9),
    SamplingSettings(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05),
    SamplingSettings(top_k=3000),
]


@pytest.mark.parametrize(
    "groups",
    [
        [[0, 1, 2, 3, 4]],  # the wide nucleus makes the whole batch sort the vocabulary
        [[0], [1], [2], [3], [4]],  # each row on its own path
        [[0, 3], [1, 2, 4]],  # a top-p row and a top-k row both inside the window
    ],
)
def test_filters_match_their_definition_on_a_large_vocab(groups: list[list[int]]) -> None:
    logits = 3 * torch.randn(len(LARGE_VOCAB_CASES), 5000, generator=torch.Generator().manual_seed(10))
    expected = torch.stack([reference_probs(x, params) for x, params in zip(logits, LARGE_VOCAB_CASES, strict=True)])
    # Both sides of the ranking window are covered: a nucleus inside it and one wider than it.
    assert 1 < (expected[0] > 0).sum() < NUCLEUS_WINDOW < (expected[1] > 0).sum()
    probs = torch.empty_like(logits)
    for group in groups:
        probs[group] = filtered_probs(logits[group], [LARGE_VOCAB_CASES[i] for i in group])
    assert torch.equal(probs > 0, expected > 0)
    assert torch.allclose(probs.double(), expected, atol=1e-6)


def test_masked_logits_are_never_sampled() -> None:
    logits = torch.zeros(VOCAB)
    logits[[0, 4]] = float("-inf")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        tokens = draw(logits.to(dtype), SamplingSettings(top_p=0.99), n=2000)
        assert set(tokens) == {1, 2, 3, 5}


def test_seeded_draws_follow_the_distribution() -> None:
    params = [SamplingSettings(top_k=3, seed=s) for s in range(DRAWS)]
    tokens = Sampler(seed=0)(LOGITS.expand(DRAWS, -1), params, [7] * DRAWS).token_ids
    assert_follows(tokens, restricted(PROBS, {3, 1, 5}))


# A batch holding the request under test: logits, params, positions, and the request's row.
Batch = tuple[torch.Tensor, list[SamplingSettings], list[int], int]
MakeBatch = Callable[[torch.Tensor, SamplingSettings, int], Batch]


def seeded_stream(
    make_batch: MakeBatch, sampler: Sampler, logits: torch.Tensor, params: SamplingSettings
) -> list[int]:
    """The request's token at positions 0..29, each sampled inside the batch ``make_batch`` builds."""
    tokens = []
    for position in range(30):
        rows, row_params, positions, index = make_batch(logits, params, position)
        tokens.append(sampler(rows, row_params, positions).token_ids[index])
    return tokens


def alone(logits: torch.Tensor, params: SamplingSettings, position: int) -> Batch:
    return logits.unsqueeze(0), [params], [position], 0


def among_others(at: int) -> MakeBatch:
    """A batch of other requests (greedy, unseeded, seeded, filtered, with logprobs) with ours at row ``at``."""

    def make(logits: torch.Tensor, params: SamplingSettings, position: int) -> Batch:
        others = torch.randn(4, logits.shape[0], generator=torch.Generator().manual_seed(position))
        other_params = [
            SamplingSettings(temperature=0.0),
            SamplingSettings(temperature=0.7, min_p=0.1, num_logprobs=3),
            SamplingSettings(seed=99, top_k=5),
            SamplingSettings(),
        ]
        rows = torch.cat([others[:at], logits.unsqueeze(0), others[at:]])
        row_params = other_params[:at] + [params] + other_params[at:]
        other_positions = [position + 11, position, position + 3, 50]
        return rows, row_params, other_positions[:at] + [position] + other_positions[at:], at

    return make


@pytest.mark.parametrize(
    "params", [SamplingSettings(seed=1234), SamplingSettings(seed=2**64 - 1, temperature=0.8, top_p=0.9)]
)
def test_seeded_request_ignores_batch_and_history(params: SamplingSettings) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(5))
    reference = seeded_stream(alone, Sampler(seed=0), logits, params)
    assert len(set(reference)) > 5, "a seeded stream must still vary with position"
    shared = Sampler(seed=1)
    for at in (0, 2, 4):
        assert seeded_stream(among_others(at), shared, logits, params) == reference
    # A restarted executor (a fresh sampler) and a replay after preemption give the same tokens.
    assert seeded_stream(alone, Sampler(), logits, params) == reference
    assert seeded_stream(alone, shared, logits, params) == reference


def test_seeded_request_matches_in_reduced_precision() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(6)).bfloat16()
    params = SamplingSettings(seed=7, top_k=20)
    sampler = Sampler(seed=0)
    assert seeded_stream(alone, sampler, logits, params) == seeded_stream(alone, sampler, logits.float(), params)


def test_different_seeds_give_different_streams() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(seed=0)
    first = seeded_stream(alone, sampler, logits, SamplingSettings(seed=1))
    assert first != seeded_stream(alone, sampler, logits, SamplingSettings(seed=2))


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(64, 1000)
    params = [SamplingSettings()] * 64
    sampler = Sampler(seed=11)
    first = sampler(logits, params, [0] * 64).token_ids
    assert len(set(first)) > 32, "rows of one batch draw independently"
    assert sampler(logits, params, [0] * 64).token_ids != first, "calls draw independently"


def test_logprobs_are_the_raw_log_softmax_most_likely_first() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(8)).half()
    params = [
        SamplingSettings(temperature=0.0, num_logprobs=3),
        SamplingSettings(temperature=0.5, top_k=2, num_logprobs=5, seed=3),
        SamplingSettings(),
        SamplingSettings(num_logprobs=0),
    ]
    out = Sampler(seed=0)(logits, params, [0, 1, 2, 3])
    reference = logits.float().log_softmax(dim=-1)
    assert len(out.logprobs) == 4
    for row, n in ((0, 3), (1, 5), (3, 0)):
        entry = out.logprobs[row]
        assert math.isclose(entry.logprob, reference[row, out.token_ids[row]].item(), abs_tol=1e-5)
        expected_ids = reference[row].argsort(descending=True)[:n].tolist()
        assert list(entry.top_token_ids) == expected_ids
        assert torch.allclose(torch.tensor(list(entry.top_logprobs)), reference[row, expected_ids], atol=1e-5)
    assert out.logprobs[2] is None
    assert out.token_ids[0] in out.logprobs[0].top_token_ids[:1]


def test_logprobs_absent_unless_asked_and_capped_at_vocab() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9))
    assert Sampler(seed=0)(logits, [SamplingSettings()] * 2, [0, 0]).logprobs == []
    out = Sampler(seed=0)(logits, [SamplingSettings(num_logprobs=100), SamplingSettings()], [0, 0])
    assert sorted(out.logprobs[0].top_token_ids) == list(range(VOCAB))


def test_empty_batch_samples_nothing() -> None:
    """A step of only unfinished prefill chunks has no rows to sample."""
    out = Sampler(seed=0)(torch.empty(0, VOCAB), [], [])
    assert out.token_ids == [] and out.logprobs == []
