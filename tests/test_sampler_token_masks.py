"""allowed_token_ids and bad_words on fixed logits: the masks against plain-Python references of vLLM's rules, rows
without them bit-identical, a verification that never accepts a banned proposal, the executor's plan checks, the
wire round trip and the scheduler's tokenization of the words (vLLM's own output on SmolLM2's tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.step import NewRequest, SamplingSettings, StepPlan
from common.step_codec import sampling_from_proto, sampling_to_proto
from executor_svc.core.request_table import PlanError, RequestState, RequestTable, ScheduledChunk
from executor_svc.sample.constraints import GrammarConstraints
from executor_svc.sample.logits_processors import apply_logits_processors
from executor_svc.sample.sampler import Sampler
from executor_svc.spec.verify import verify
from scheduler_svc.core.bad_words import bad_words_token_ids, first_banned
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.model_fixtures import smollm2_folder  # noqa: F401

VOCAB = 16
EOS = 2


def request(token_ids: list[int], settings: SamplingSettings, num_prompt_tokens: int) -> RequestState:
    return RequestState(0, list(token_ids), [], len(token_ids), settings, num_prompt_tokens)


def banned_reference(words: list[list[int]], completion: list[int]) -> set[int]:
    """vLLM's rule in plain Python: a word's last id is banned when the completion ends with the ids before it."""
    return {word[-1] for word in words
            if len(word) - 1 <= len(completion) and completion[len(completion) - len(word) + 1:] == word[:-1]}


def test_allowed_ids_keep_only_their_logits_and_other_rows_are_untouched() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    settings = [SamplingSettings(temperature=0.0, allowed_token_ids=(1, 5, 9)),
                SamplingSettings(temperature=0.0),
                SamplingSettings(temperature=0.7, allowed_token_ids=(0, 15), logit_bias=((0, 3.0),)),
                SamplingSettings(temperature=0.0, presence_penalty=1.0)]
    states = [request([3, 4], s, 1) for s in settings]
    out = apply_logits_processors(logits, settings, states, (EOS,))
    for row, kept in ((0, {1, 5, 9}), (2, {0, 15})):
        for t in range(VOCAB):
            expected = logits[row, t] + (3.0 if (row, t) == (2, 0) else 0.0) if t in kept else float("-inf")
            assert out[row, t].item() == pytest.approx(float(expected)), (row, t)
    assert torch.equal(out[1], logits[1])


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.5])
def test_sampled_tokens_never_leave_the_allowed_ids(temperature: float) -> None:
    allowed = (3, 4, 11)
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    settings = [SamplingSettings(temperature=temperature, top_p=0.9 if i % 2 else 1.0, seed=i if i % 3 else None,
                                 allowed_token_ids=allowed) for i in range(64)]
    states = [request([1], s, 1) for s in settings]
    tokens = Sampler(seed=0, eos_token_ids=(EOS,))(logits, settings, [1] * 64, states).token_ids
    assert set(tokens) <= set(allowed)
    if temperature == 0.0:
        restricted = logits[:, list(allowed)].argmax(dim=-1)
        assert tokens == [allowed[i] for i in restricted.tolist()]
    else:
        assert len(set(tokens)) > 1


def test_bad_words_ban_as_vllm_does_on_random_cases() -> None:
    """Only the completion holds a word's prefix (a prompt ending with it bans nothing), one-token words are always
    banned, and several words sharing a prefix ban all their last ids."""
    rng = random.Random(0)
    for _ in range(500):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]
        prompt = [rng.randrange(6) for _ in range(4)]
        completion = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        settings = SamplingSettings(temperature=0.0, bad_words_token_ids=tuple(map(tuple, words)))
        states = [request(prompt + completion, settings, len(prompt)), request(prompt + completion,
                                                                                 SamplingSettings(), len(prompt))]
        logits = torch.zeros(2, VOCAB)
        out = apply_logits_processors(logits, [settings, SamplingSettings()], states, (EOS,))
        assert set(torch.isneginf(out[0]).nonzero().flatten().tolist()) == banned_reference(words, completion)
        assert torch.equal(out[1], logits[1])


def test_greedy_decoding_under_bad_words_never_completes_one() -> None:
    """Decoding step by step, each token appended as the executor records it, from logits that favour 7 8 9 over and
    over: 9 is banned after 7 8, so 7 8 repeats; the one-token word 10 is never sampled."""
    settings = SamplingSettings(temperature=0.0, bad_words_token_ids=((7, 8, 9), (10,)))
    state = request([1], settings, 1)
    sampler = Sampler(seed=0)
    for _ in range(12):
        logits = torch.full((1, VOCAB), -5.0)
        logits[0, [7, 10]] = torch.tensor([4.0, 3.0])
        logits[0, {7: 8, 8: 9}.get(state.token_ids[-1], 7)] = 10.0  # the next token of 7 8 9
        state.token_ids += sampler(logits, [settings], [len(state.token_ids)], [state]).token_ids
    completion = state.token_ids[1:]
    assert completion == [7, 8] * 6
    assert first_banned(completion, [[7, 8, 9], [10]]) is None
    assert first_banned([7, 8, 9], [[7, 8, 9]]) == 2 and first_banned([10], [[10]]) == 0


def test_a_verification_never_accepts_a_banned_proposal() -> None:
    """The proposal 9 after 7 8 is the model's favourite but completes a bad word: it is rejected there and the
    token sampled in its place is the row's own; the proposals before it are accepted, and nothing stays
    appended to the request."""
    settings = SamplingSettings(temperature=0.0, bad_words_token_ids=((8, 9),))
    state = request([1, 2, 3, 7], settings, 3)
    chunk = ScheduledChunk(state, 3, 4, num_drafts=3, drafts=[8, 9, 4])
    logits = torch.zeros(4, VOCAB)
    for row, favourite in enumerate((8, 9, 4, 5)):  # the proposals are the argmax at their positions
        logits[row, favourite] = 10.0
    logits[1, 6] = 5.0
    constraints = GrammarConstraints(Path("/nonexistent"), VOCAB, (EOS,))
    verified = verify(logits, [chunk], Sampler(seed=0), constraints)
    assert verified.token_ids == [[8, 6]]
    assert state.token_ids == [1, 2, 3, 7]


def test_the_executor_refuses_ids_outside_the_vocabulary_and_empty_words() -> None:
    table = RequestTable(num_blocks=8, block_size=4, vocab_size=VOCAB, max_model_len=64)
    for settings in (SamplingSettings(allowed_token_ids=(3, VOCAB)),
                     SamplingSettings(bad_words_token_ids=((1, VOCAB),)), SamplingSettings(bad_words_token_ids=((),))):
        plan = StepPlan(1, True, new_requests=[NewRequest(1, [1, 2], settings, [0], 0, 2)])
        with pytest.raises(PlanError) as refused:
            table.apply(plan)
        assert refused.value.code == "INVALID_ARGUMENT"
        assert len(table) == 0


def test_the_settings_cross_the_wire_and_count_as_processors() -> None:
    settings = SamplingSettings(temperature=0.0, allowed_token_ids=(0, 3, 7), bad_words_token_ids=((5,), (1, 2, 3)))
    assert sampling_from_proto(sampling_to_proto(settings)) == settings
    assert settings.has_logits_processors and not settings.plain_greedy
    assert sampling_from_proto(sampling_to_proto(SamplingSettings())) == SamplingSettings()
    assert not SamplingSettings(temperature=0.0).has_logits_processors


def test_words_tokenize_as_vllm_tokenizes_them_on_smollm2(smollm2_folder: Path) -> None:  # noqa: F811
    """Expected: vLLM 0.32's ``SamplingParams.update_from_tokenizer`` on this tokenizer. The spaced form is kept only
    where it starts with another token and has as many ("ünïcode" spaced is one token longer)."""
    tokenizer = ModelTokenizer((smollm2_folder / "tokenizer.json").read_text())
    vllm = {"Paris": [[38634], [7042]], " Paris": [[38634], [7042]], "hello world": [[28120, 905], [33662, 905]],
            "  indented": [[526, 6574], [641, 6574]], "New York City": [[5529, 2863, 4206], [1315, 2863, 4206]],
            "ünïcode": [[47682, 25972, 4635]], "🎉": [[10813, 232, 227], [15107, 232, 227]],
            "\tTab": [[30064], [19653]]}
    for word, expected in vllm.items():
        assert bad_words_token_ids([word], tokenizer) == expected, word
    # Repeated words count once; different words that tokenize alike count each (as vLLM's do).
    assert bad_words_token_ids(["Paris", "Paris", " Paris"], tokenizer) == [[38634], [7042], [38634], [7042]]
    for words, reason in (([""], "must not be empty"), (["  "], "encodes to no tokens")):
        with pytest.raises(InvalidRequest) as refused:
            bad_words_token_ids(words, tokenizer)
        assert refused.value.field == "bad_words" and reason in refused.value.reason
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        bad_words_token_ids(["Paris"], None)
