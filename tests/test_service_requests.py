"""Translating a public GenerateRequest into engine input: defaults and the field each refusal names."""

from __future__ import annotations

import math

import pytest

from common.sampling import DEFAULTS
from common.step import ExecutorInfo
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from tests.service_fixtures import CHATML_TEMPLATE, EOS_ID, byte_level_tokenizer

INFO = ModelLimits.of(ExecutorInfo(vocab_size=300, max_model_len=64, eos_token_ids=(EOS_ID,),
                                   num_blocks=64, block_size=16))


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(byte_level_tokenizer().to_str(), CHATML_TEMPLATE, None, (EOS_ID,))


def tokens(*ids: int, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=ids), **kwargs)


def test_defaults_match_the_proto_documentation():
    prepared = prepare(tokens(1, 2, 3), INFO, None)
    p = prepared.params
    assert prepared.prompt_token_ids == [1, 2, 3]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.logprobs) == (1.0, 0, 1.0, 0.0, None, None)
    assert (p.ignore_eos, p.stop, p.stop_token_ids) == (False, [], frozenset())
    assert p.max_tokens == min(DEFAULTS["max_tokens"], 64 - 3)
    assert len(prepared.request_id) == 32


def test_options_are_carried_over():
    request = tokens(
        5, request_id="r1",
        sampling=pb.SamplingOptions(temperature=0, top_k=5, top_p=0.5, min_p=0.25, seed=7, logprobs=3),
        stopping=pb.StoppingOptions(max_tokens=10, stop=["x"], stop_token_ids=[4], ignore_eos=True),
    )
    prepared = prepare(request, INFO, ModelTokenizer(byte_level_tokenizer().to_str()))
    p = prepared.params
    assert prepared.request_id == "r1"
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.logprobs) == (0, 5, 0.5, 0.25, 7, 3)
    assert (p.max_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (10, ["x"], {4}, True)


def test_text_is_tokenized_with_special_tokens_unless_told_not_to(tokenizer: ModelTokenizer):
    assert prepare(pb.GenerateRequest(text="héllo"), INFO, tokenizer).prompt_token_ids == tokenizer.encode("héllo")
    request = pb.GenerateRequest(text="héllo", add_special_tokens=False)
    assert prepare(request, INFO, tokenizer).prompt_token_ids == tokenizer.encode("héllo", add_special_tokens=False)


@pytest.mark.parametrize(
    ("request_", "field", "detail"),
    [
        (pb.GenerateRequest(), "prompt", "no prompt"),
        (tokens(), "tokens.token_ids", "empty"),
        (tokens(1, 300), "tokens.token_ids", "token id 300 at position 1"),
        (tokens(*[1] * 64), "prompt", "64 tokens"),
        (tokens(1, stopping=pb.StoppingOptions(max_tokens=64)), "stopping.max_tokens", "1 tokens + max_tokens 64 = 65"),
        (tokens(1, stopping=pb.StoppingOptions(max_tokens=0)), "stopping.max_tokens", ">= 1"),
        (tokens(1, sampling=pb.SamplingOptions(temperature=-1)), "sampling.temperature", ">= 0"),
        (tokens(1, sampling=pb.SamplingOptions(temperature=math.nan)), "sampling.temperature", "nan"),
        (tokens(1, sampling=pb.SamplingOptions(temperature=math.inf)), "sampling.temperature", "inf"),
        (tokens(1, sampling=pb.SamplingOptions(top_p=0)), "sampling.top_p", "(0, 1]"),
        (tokens(1, sampling=pb.SamplingOptions(top_p=1.01)), "sampling.top_p", "(0, 1]"),
        (tokens(1, sampling=pb.SamplingOptions(min_p=2)), "sampling.min_p", "[0, 1]"),
        (tokens(1, sampling=pb.SamplingOptions(logprobs=21)), "sampling.logprobs", "[0, 20]"),
        (tokens(1, stopping=pb.StoppingOptions(stop=["a", ""])), "stopping.stop", "empty"),
        (tokens(1, stopping=pb.StoppingOptions(stop=[f"s{i}" for i in range(17)])), "stopping.stop", "at most 16"),
        (tokens(1, stopping=pb.StoppingOptions(stop_token_ids=range(65))), "stopping.stop_token_ids", "at most 64"),
        (tokens(1, stopping=pb.StoppingOptions(stop_token_ids=[300])), "stopping.stop_token_ids", "token id 300"),
        (tokens(1, sampling=pb.SamplingOptions(n=0)), "sampling.n", "[1, 16], got 0"),
        (tokens(1, sampling=pb.SamplingOptions(n=17)), "sampling.n", "[1, 16], got 17"),
        (tokens(1, sampling=pb.SamplingOptions(repetition_penalty=0)), "sampling.repetition_penalty", "> 0"),
        (tokens(1, sampling=pb.SamplingOptions(repetition_penalty=math.inf)), "sampling.repetition_penalty", "> 0"),
        (tokens(1, sampling=pb.SamplingOptions(presence_penalty=2.5)), "sampling.presence_penalty", "[-2, 2]"),
        (tokens(1, sampling=pb.SamplingOptions(frequency_penalty=-3)), "sampling.frequency_penalty", "[-2, 2]"),
        (tokens(1, sampling=pb.SamplingOptions(logit_bias={5: 101})), "sampling.logit_bias", "token 5"),
        (tokens(1, sampling=pb.SamplingOptions(logit_bias={300: 1})), "sampling.logit_bias", "token id 300"),
        (tokens(1, stopping=pb.StoppingOptions(max_tokens=4, min_tokens=5)), "stopping.min_tokens", "at most"),
        (tokens(1, truncate_prompt_tokens=0), "truncate_prompt_tokens", ">= 1"),
        (tokens(1, stream_interval=0), "stream_interval", ">= 1, got 0"),
    ],
)
def test_bad_input_names_its_field(
    request_: pb.GenerateRequest, field: str, detail: str, tokenizer: ModelTokenizer
):
    with pytest.raises(InvalidRequest) as e:
        prepare(request_, INFO, tokenizer)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ") and detail in str(e.value)


def test_a_request_larger_than_the_whole_cache_is_refused_before_it_is_queued():
    small = ModelLimits(vocab_size=300, max_model_len=64, num_blocks=3, block_size=16)
    with pytest.raises(InvalidRequest, match="stopping.max_tokens: sequence needs 4 KV blocks"):
        prepare(tokens(1, stopping=pb.StoppingOptions(max_tokens=63)), small, None)
    assert prepare(tokens(1, stopping=pb.StoppingOptions(max_tokens=48)), small, None).params.max_tokens == 48


def test_stop_token_ids_are_bounded_and_held_as_a_set():
    """Unbounded, they were scanned linearly on the loop thread for every sampled token."""
    request = tokens(1, stopping=pb.StoppingOptions(stop_token_ids=[*range(64), 5]))
    assert prepare(request, INFO, None).params.stop_token_ids == frozenset(range(64))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(text="hi"), "text"),
        (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])), "chat"),
        (tokens(1, stopping=pb.StoppingOptions(stop=["x"])), "stopping.stop"),
    ],
)
def test_text_features_need_a_tokenizer(request_: pb.GenerateRequest, field: str):
    with pytest.raises(InvalidRequest) as e:
        prepare(request_, INFO, None)
    assert e.value.field == field and "tokenizer" in str(e.value)


def test_chat_refusals_name_the_message(tokenizer: ModelTokenizer):
    empty = pb.GenerateRequest(chat=pb.ChatPrompt())
    with pytest.raises(InvalidRequest, match="chat.messages: the conversation is empty"):
        prepare(empty, INFO, tokenizer)
    roles = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="tool"), pb.ChatMessage(role="bot")]))
    with pytest.raises(InvalidRequest, match=r"chat.messages\[1\].role: unknown role 'bot'"):
        prepare(roles, INFO, tokenizer)


def test_every_allowed_role_renders(tokenizer: ModelTokenizer):
    roles = ("system", "user", "assistant", "tool")
    messages = [pb.ChatMessage(role=r, content=r) for r in roles]
    prepared = prepare(pb.GenerateRequest(chat=pb.ChatPrompt(messages=messages, add_generation_prompt=False)),
                       INFO, tokenizer)
    assert tokenizer.decode(prepared.prompt_token_ids) == "".join(f"{r}\n{r}\n" for r in roles)


def test_a_template_that_raises_is_reported_as_invalid_chat():
    strict = ModelTokenizer(byte_level_tokenizer().to_str(), "{{ raise_exception('only one message') }}")
    request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")]))
    with pytest.raises(InvalidRequest, match="chat: the chat template refused the conversation: only one message"):
        prepare(request, INFO, strict)


def test_a_template_cannot_reach_python_internals():
    sneaky = ModelTokenizer(byte_level_tokenizer().to_str(), "{{ messages.__class__.__mro__ }}")
    request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")]))
    with pytest.raises(InvalidRequest, match="chat"):
        prepare(request, INFO, sneaky)
