"""Structured output without the model: the scheduler refuses a bad constraint at entry, naming its field
with the library's message; a good one reaches the executor as one grammar, whose matcher masks logits,
follows the sampled tokens and is rebuilt from the completion tokens of a request that comes back."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from common.step import SamplingSettings
from common.step_codec import plan_from_proto, plan_to_proto, sampling_from_proto, sampling_to_proto
from executor_svc.core.request_table import RequestState, RequestTable
from executor_svc.sample.constraints import GrammarConstraints
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.planner import Planner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from tests.service_fixtures import EOS_ID, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

LIMITS = ModelLimits(vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=256, num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_level_tokenizer().to_str()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_json, eos_token_ids=(EOS_ID,))


def request(**structured: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Hello world", structured_output=pb.StructuredOutput(**structured))


BAD = [
    ({"json_schema": '{"type": "object",'}, "structured_output.json_schema", "not valid JSON: Expecting"),
    ({"json_schema": "[1, 2]"}, "structured_output.json_schema", "must be a JSON object"),
    ({"json_schema": '{"type": "foo"}'}, "structured_output.json_schema", "Invalid type: foo"),
    ({"json_schema": '{"type": "string", "pattern": "("}'}, "structured_output.json_schema", "unclosed group"),
    ({"json_schema": '{"type": "integer", "minimum": 5, "maximum": 1}'}, "structured_output.json_schema",
     "Unsatisfiable"),
    ({"regex": "a(b"}, "structured_output.regex", "unclosed group"),
    ({"regex": "[z-a]"}, "structured_output.regex", "invalid character class range"),
    ({"choice": pb.ChoiceList()}, "structured_output.choice", "the choice list is empty"),
    ({"choice": pb.ChoiceList(choices=["yes", ""])}, "structured_output.choice", "must not be empty strings"),
    ({"grammar": "start: foo"}, "structured_output.grammar", 'unknown name: "foo"'),
    ({"grammar": 'start: "a" ('}, "structured_output.grammar", "Expected token ')'"),
    ({"grammar": "start: /[/"}, "structured_output.grammar", "unclosed character class"),
    ({"grammar": "root ::= ("}, "structured_output.grammar", "not a Lark or GBNF grammar"),
    ({"grammar": ""}, "structured_output.grammar", "not a Lark or GBNF grammar"),  # no start rule: a 500 once
    ({"grammar": 'item ::= "a"'}, "structured_output.grammar", "not a Lark or GBNF grammar"),
]


@pytest.mark.parametrize(("structured", "field", "message"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_constraint_is_refused_naming_its_field_with_the_library_message(tokenizer, structured, field, message):
    with pytest.raises(InvalidRequest) as refused:
        prepare(request(**structured), LIMITS, tokenizer)
    assert refused.value.field == field
    assert message in refused.value.reason


def test_structured_output_needs_a_tokenizer():
    tokens = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[5, 6]), structured_output=pb.StructuredOutput(
        regex="[ab]+"))
    with pytest.raises(InvalidRequest) as refused:
        prepare(tokens, LIMITS, None)
    assert refused.value.field == "structured_output"


@pytest.mark.parametrize("structured", [
    {"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})},
    {"regex": "[ab]+"},
    {"choice": pb.ChoiceList(choices=["héllo", 'a "quoted" one'])},
    {"grammar": 'start: "x" NUM\nNUM: /[0-9]+/'},
    {"json_object": True},
], ids=["json_schema", "regex", "choice", "grammar", "json_object"])
def test_a_good_constraint_reaches_the_executor_as_its_grammar(tokenizer, structured):
    params = prepare(request(**structured), LIMITS, tokenizer).params
    assert params.grammar and json.loads(params.grammar)["grammars"]
    assert sampling_from_proto(sampling_to_proto(params.settings)).grammar == params.grammar


def test_a_gbnf_grammar_is_taken_as_vllm_takes_it(tokenizer):
    # llama.cpp's EBNF (root ::= ...), which vLLM's structured outputs take too, reaches the executor as Lark.
    params = prepare(request(grammar='root ::= "x" num\nnum ::= [0-9]+'), LIMITS, tokenizer).params
    (lark_grammar,) = (g["lark_grammar"] for g in json.loads(params.grammar)["grammars"])
    assert "start:" in lark_grammar and "::=" not in lark_grammar


@pytest.mark.parametrize("structured", [None, {}, {"json_object": False}], ids=["absent", "empty", "json_object_off"])
def test_no_constraint_sends_no_grammar(tokenizer, structured):
    message = pb.GenerateRequest(text="Hello") if structured is None else request(**structured)
    params = prepare(message, LIMITS, tokenizer).params
    assert params.grammar is None
    assert not sampling_to_proto(params.settings).HasField("grammar")


def test_a_request_that_comes_back_names_its_prompt_length():
    seq = Sequence(7, [1, 2, 3], SamplingParams(grammar="g"), block_size=4)
    seq.token_ids += [4, 5]  # two completion tokens, then preempted
    seq.block_table, seq.num_scheduled_tokens = [0, 1], 5
    plan, _ = Planner().build([seq], True, [])
    message = plan_to_proto(plan)
    assert message.new_requests[0].num_prompt_tokens == 3
    table = RequestTable(num_blocks=8, block_size=4, vocab_size=50, max_model_len=64)
    state = table.apply(plan_from_proto(message))[0].state
    assert (state.num_prompt_tokens, state.sampling.grammar) == (3, "g")
    message.new_requests[0].ClearField("num_prompt_tokens")
    assert RequestTable(8, 4, 50, 64).apply(plan_from_proto(message))[0].state.num_prompt_tokens == 5, \
        "absent means all"


def allowed(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if not math.isinf(x)}


def test_matchers_mask_their_rows_follow_tokens_and_replay_a_completion(tmp_path: Path, tokenizer_json, tokenizer):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json)
    constraints = GrammarConstraints(path, TOKENIZER_VOCAB_SIZE, [EOS_ID])
    grammar = prepare(request(regex="[ab]{1,3}"), LIMITS, tokenizer).params.grammar
    prompt = tokenizer.encode("Hello")
    fresh = RequestState(0, list(prompt), [], 0, SamplingSettings(grammar=grammar), len(prompt))
    plain = RequestState(1, list(prompt), [], 0, SamplingSettings(), len(prompt))
    a, b = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("b", add_special_tokens=False)
    # Came back after preemption with "ab" generated: one more letter at most, or EOS.
    back = RequestState(2, list(prompt) + a + b, [], 0, SamplingSettings(grammar=grammar), len(prompt))
    logits = torch.zeros(3, TOKENIZER_VOCAB_SIZE)
    rows = constraints.mask(logits, [fresh, plain, back])
    assert rows == [0, 2]
    letters = {i for i in range(TOKENIZER_VOCAB_SIZE) if re.fullmatch("[ab]{1,3}", tokenizer.decode([i]))}
    assert allowed(logits[0]) == letters
    assert allowed(logits[1]) == set(range(TOKENIZER_VOCAB_SIZE)), "an unconstrained row is untouched"
    assert allowed(logits[2]) == {*a, *b, EOS_ID}
    constraints.advance([fresh, plain, back], rows, [a[0], 9, b[0]])
    logits = torch.zeros(3, TOKENIZER_VOCAB_SIZE)
    constraints.mask(logits, [fresh, plain, back])
    assert EOS_ID in allowed(logits[0])
    assert allowed(logits[2]) == {EOS_ID}, "a complete grammar allows only EOS"
