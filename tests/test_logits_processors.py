"""The logits processors on fixed logits: penalties against plain-Python references, bias, min_tokens.

Each batch mixes rows with different settings and rows without any, which must come out bit-identical.
Decoding loops append each sampled token to the request, as ``record_sampled`` does, so the counts the
processors keep step by step are checked against counts taken afresh from the tokens.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.step import SamplingSettings
from executor_svc.core.request_table import RequestState
from executor_svc.sample import sampler as sampler_module
from executor_svc.sample.logits_processors import TokenCounts, apply_logits_processors
from executor_svc.sample.sampler import Sampler

VOCAB = 40
EOS = 2


def request(token_ids: list[int], settings: SamplingSettings, num_prompt_tokens: int) -> RequestState:
    return RequestState(0, list(token_ids), [], len(token_ids), settings, num_prompt_tokens)


def openai_penalized(logits: list[float], completion: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's formula in plain Python: logit[t] -= frequency * count[t] + presence * (count[t] > 0)."""
    counts = [completion.count(t) for t in range(len(logits))]
    return [x - (frequency * c + presence * (c > 0)) for x, c in zip(logits, counts, strict=True)]


def greedy_decode(logits: torch.Tensor, states: list[RequestState], steps: int) -> list[list[int]]:
    """Greedy tokens of every row over ``steps`` steps of the same logits, appended as the executor does."""
    sampler = Sampler(seed=0, eos_token_ids=(EOS,))
    rows = [state.sampling for state in states]
    out: list[list[int]] = [[] for _ in states]
    for _ in range(steps):
        tokens = sampler(logits, rows, [len(s.token_ids) for s in states], states).token_ids
        for state, token_id, row_out in zip(states, tokens, out, strict=True):
            state.token_ids.append(token_id)
            row_out.append(token_id)
    return out


def test_presence_and_frequency_penalties_follow_the_openai_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator) * 2
    prompt = logits[0].topk(3).indices.tolist()  # the best tokens of row 0, which the prompt must not penalise
    settings = [
        SamplingSettings(temperature=0.0, frequency_penalty=0.75),
        SamplingSettings(temperature=0.0),
        SamplingSettings(temperature=0.0, presence_penalty=1.5),
        SamplingSettings(temperature=0.0, frequency_penalty=-0.5, presence_penalty=2.0),
        SamplingSettings(temperature=0.0, frequency_penalty=2.0, presence_penalty=-2.0),
        SamplingSettings(temperature=0.0, num_logprobs=1),
    ]
    states = [request(prompt, s, len(prompt)) for s in settings]
    tokens = greedy_decode(logits, states, 12)

    expected = []
    for row, s in enumerate(settings):
        completion: list[int] = []
        for _ in range(12):
            scores = openai_penalized(logits[row].tolist(), completion, s.presence_penalty, s.frequency_penalty)
            completion.append(max(range(VOCAB), key=scores.__getitem__))
        expected.append(completion)
    assert tokens == expected
    assert tokens[0][0] == prompt[0], "a prompt token is penalised as if it were in the completion"
    assert len(set(tokens[0])) > 1 and len(set(tokens[2])) > 1, "the penalties never changed a token"
    assert len(set(tokens[1])) == 1

    # The logits behind the last step, row by row; rows without processors are left bit-identical.
    processed = apply_logits_processors(logits, settings, states, (EOS,))
    for row in (1, 5):
        assert torch.equal(processed[row], logits[row])
    for row in (0, 2, 3, 4):
        s = settings[row]
        reference = openai_penalized(logits[row].tolist(), tokens[row], s.presence_penalty, s.frequency_penalty)
        assert torch.allclose(processed[row], torch.tensor(reference), rtol=0, atol=1e-5)


def test_repetition_penalty_scales_each_seen_token_once() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 4.0], [2.0, -2.0, 3.0, -1.0, 0.5, 4.0]])
    settings = [SamplingSettings(repetition_penalty=2.0), SamplingSettings(repetition_penalty=0.5)]
    # Prompt [0, 1, 0], completion [3, 3]: tokens 0, 1 and 3 are seen, 0 and 3 twice.
    states = [request([0, 1, 0, 3, 3], s, 3) for s in settings]
    processed = apply_logits_processors(logits, settings, states, ())
    assert processed.tolist() == [[1.0, -4.0, 3.0, -2.0, 0.5, 4.0], [4.0, -1.0, 3.0, -0.5, 0.5, 4.0]]


def test_logit_bias_forces_and_bans_tokens_and_comes_before_the_penalties() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0], [1.0, 0.0, 0.0, 3.0]])
    settings = [
        SamplingSettings(temperature=0.0, logit_bias=((2, -100.0),)),
        SamplingSettings(temperature=0.0, logit_bias=((0, 5.5),)),
        # Token 0 (in the prompt) biased to 4.0, then halved: 2.0 loses to token 3; penalised first it would win.
        SamplingSettings(temperature=0.0, logit_bias=((0, 3.0),), repetition_penalty=2.0),
    ]
    states = [request([0], s, 1) for s in settings]
    assert Sampler(seed=0)(logits, settings, [1] * 3, states).token_ids == [3, 0, 3]
    processed = apply_logits_processors(logits, settings, states, ())
    assert processed.tolist() == [[0.0, 1.0, -95.0, 2.0], [5.5, 1.0, 5.0, 2.0], [2.0, 0.0, 0.0, 3.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_the_completion_is_long_enough() -> None:
    # EOS is the best token, stop id 5 the second, 7 the third: masked, each row falls to the next.
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS], logits[:, 5], logits[:, 7] = 3.0, 2.0, 1.0
    settings = [
        SamplingSettings(temperature=0.0, min_tokens=3),
        SamplingSettings(temperature=0.0, min_tokens=3, stop_token_ids=(5,)),
        SamplingSettings(temperature=0.0, min_tokens=3, stop_token_ids=(5, VOCAB + 9), ignore_eos=True),
        SamplingSettings(temperature=0.0),
    ]
    states = [request([11, 12], s, 2) for s in settings]
    assert greedy_decode(logits, states, 4) == [[5, 5, 5, EOS], [7, 7, 7, EOS], [EOS] * 4, [EOS] * 4]


def test_a_preempted_request_counts_only_the_completion_it_comes_back_with() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0]])
    s = SamplingSettings(temperature=0.0, presence_penalty=0.5)
    # Came back with prompt [0] and completion [1, 0]: 0 and 1 penalised, 2 wins; as all prompt, 0 would.
    assert Sampler(seed=0)(logits, [s], [3], [request([0, 1, 0], s, 1)]).token_ids == [2]
    assert Sampler(seed=0)(logits, [s], [3], [request([0, 1, 0], s, 3)]).token_ids == [0]


def test_logprobs_stay_those_of_the_raw_model() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    s = SamplingSettings(temperature=0.0, num_logprobs=2, logit_bias=((0, -100.0),), frequency_penalty=2.0)
    out = Sampler(seed=0)(logits, [s], [1], [request([1], s, 0)])
    raw = logits.log_softmax(dim=-1)[0]
    assert out.token_ids == [2]
    entry = out.logprobs[0]
    assert entry.logprob == pytest.approx(raw[2].item())
    assert entry.top_token_ids == [0, 1] and entry.top_logprobs == pytest.approx(raw[:2].tolist())


def test_a_batch_without_processors_never_reaches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("logits processors ran for a batch that uses none")

    monkeypatch.setattr(sampler_module, "apply_logits_processors", fail)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [SamplingSettings(temperature=0.0), SamplingSettings(top_k=5, seed=1), SamplingSettings(num_logprobs=0)]
    assert len(Sampler(seed=0)(logits, rows, [1, 1, 1]).token_ids) == 3
    assert not any(row.has_logits_processors for row in rows)


def test_token_counts_grown_step_by_step_equal_counts_taken_afresh() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(5000) for _ in range(300)]
    tokens = list(prompt)
    counts = TokenCounts(tokens, len(prompt))
    for _ in range(700):  # past the first capacity: many new distinct ids, some repeats
        tokens.append(rng.randrange(5000) if rng.random() < 0.7 else rng.choice(tokens))
        ids, grown = counts.update(tokens)
    fresh_ids, fresh = TokenCounts(tokens, len(prompt)).update(tokens)
    assert dict(zip(ids.tolist(), grown.tolist(), strict=True)) == dict(
        zip(fresh_ids.tolist(), fresh.tolist(), strict=True)
    )
    completion = tokens[len(prompt) :]
    assert sorted(ids.tolist()) == sorted(set(tokens))
    assert all(math.isclose(c, completion.count(t)) for t, c in zip(ids.tolist(), grown.tolist(), strict=True))


def test_a_grammar_that_allows_only_eos_outranks_min_tokens():
    """The grammar's mask (-inf but EOS) came first; min_tokens must not leave the row without any token."""
    vocab, eos = 8, 2
    logits = torch.full((2, vocab), float("-inf"))
    logits[0, eos] = 0.5
    logits[1] = torch.arange(vocab, dtype=torch.float32)
    settings = SamplingSettings(temperature=0.0, min_tokens=5)
    rows = [settings, settings]
    requests = [request([1, 2, 3], settings, num_prompt_tokens=3)] * 2
    out = apply_logits_processors(logits, rows, requests, (eos,))
    assert out[0].argmax().item() == eos and torch.isfinite(out[0, eos])
    assert torch.isneginf(out[1, eos]) and out[1].argmax().item() == vocab - 1
