"""Structured output behind ``--reasoning-parser``, as vLLM gates it: the grammar waits for the thinking's end
(``</think>``) unless the prompt closed the thinking already, masks nothing before it, and follows the tokens after
it; a request that comes back finds where its grammar started in its completion."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken

from common.step import SamplingSettings
from common.step_codec import sampling_from_proto, sampling_to_proto
from executor_svc.core.request_table import RequestState
from executor_svc.sample.constraints import GrammarConstraints
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.api.structured import thinking_markers
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from tests.service_fixtures import EOS_ID, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

VOCAB = TOKENIZER_VOCAB_SIZE + 2  # the trained vocabulary and the two thinking markers
LIMITS = ModelLimits(vocab_size=VOCAB, max_model_len=256, num_blocks=64, block_size=16)
REGEX = "[ab]{1,3}"


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_json, eos_token_ids=(EOS_ID,))


def ids(tokenizer: ModelTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def gated(tokenizer: ModelTokenizer, prompt: list[int], parser: str = "qwen3") -> int | None:
    request = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=prompt),
                                 structured_output=pb.StructuredOutput(regex=REGEX))
    prepared = prepare(request, LIMITS, tokenizer, thinking=thinking_markers(tokenizer, parser))
    return prepared.params.grammar_after_token_id


def test_the_grammar_waits_for_the_thinking_unless_the_prompt_closed_it(tokenizer):
    start, end = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    hello = ids(tokenizer, "Hello")
    assert gated(tokenizer, hello) == end, "thinking comes first: the prompt says nothing of it"
    assert gated(tokenizer, [*hello, start]) == end, "a template that opens the thinking (DeepSeek-R1's)"
    assert gated(tokenizer, [*hello, start, *ids(tokenizer, "\n\n"), end, *ids(tokenizer, "\n\n")]) is None, \
        "thinking off (Qwen3's template writes it closed): the grammar applies at once"
    assert gated(tokenizer, [*hello, start, end, start]) == end, "the last marker counts"
    assert gated(tokenizer, hello, parser="") is None, "no --reasoning-parser: no gate"
    plain = ModelTokenizer(byte_level_tokenizer().to_str(), eos_token_ids=(EOS_ID,))
    assert thinking_markers(plain, "qwen3") is None, "a vocabulary without the markers: no gate"
    unconstrained = prepare(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=hello)), LIMITS, tokenizer,
                            thinking=thinking_markers(tokenizer, "qwen3"))
    assert unconstrained.params.grammar_after_token_id is None, "no grammar, nothing to gate"


def test_the_gate_crosses_the_wire():
    settings = SamplingSettings(grammar="{}", grammar_after_token_id=7)
    assert sampling_from_proto(sampling_to_proto(settings)).grammar_after_token_id == 7
    assert not sampling_to_proto(SamplingSettings(grammar="{}")).HasField("grammar_after_token_id")


def allowed(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if not math.isinf(x)}


def test_the_executor_masks_nothing_before_the_end_of_thinking_and_follows_the_grammar_after(
        tmp_path: Path, tokenizer_json: str, tokenizer: ModelTokenizer):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json)
    constraints = GrammarConstraints(path, VOCAB, [EOS_ID])
    end = tokenizer.token_id("</think>")
    request = pb.GenerateRequest(text="Hello", structured_output=pb.StructuredOutput(regex=REGEX))
    settings = prepare(request, LIMITS, tokenizer, thinking=thinking_markers(tokenizer, "qwen3")).params.settings
    assert settings.grammar_after_token_id == end
    prompt = ids(tokenizer, "Hello")
    a, b, x = (ids(tokenizer, t)[0] for t in ("a", "b", "x"))
    thinking = RequestState(0, list(prompt), [], 0, settings, len(prompt))
    # Came back after preemption: thought "x", ended it, then wrote "a": "b" or EOS may follow, and "a" once more.
    back = RequestState(1, [*prompt, x, end, a], [], 0, settings, len(prompt))
    still = RequestState(2, [*prompt, x, x], [], 0, settings, len(prompt))
    states = [thinking, back, still]
    letters = {i for i in range(VOCAB) if re.fullmatch(REGEX, tokenizer.decode([i]))}
    logits = torch.zeros(3, VOCAB)
    rows = constraints.mask(logits, states)
    assert rows == [0, 1, 2]
    assert allowed(logits[0]) == set(range(VOCAB)), "thinking: nothing masked"
    assert allowed(logits[1]) == {a, b, EOS_ID}
    assert allowed(logits[2]) == set(range(VOCAB))
    constraints.advance(states, rows, [x, b, end])  # the first thinks on, the third ends its thinking
    logits = torch.zeros(3, VOCAB)
    constraints.mask(logits, states)
    assert allowed(logits[0]) == set(range(VOCAB))
    assert allowed(logits[1]) == {a, b, EOS_ID}
    assert allowed(logits[2]) == letters, "the grammar starts after </think>"
    constraints.advance(states, rows, [end, a, a])
    logits = torch.zeros(3, VOCAB)
    constraints.mask(logits, states)
    assert allowed(logits[0]) == letters
    assert allowed(logits[1]) == {EOS_ID}, "'aba': the grammar is complete"
    assert allowed(logits[2]) == {a, b, EOS_ID}
