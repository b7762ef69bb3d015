"""Text, chat and stop rules end to end, against the echo executor (each completion repeats its prompt).

The echo makes the expected text exact: a prompt's text comes back token for
token, so multi-byte characters split across tokens, stop strings spanning
tokens and stop tokens can be placed where a test wants them.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.detokenizer import REPLACEMENT_CHAR
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    EOS_ID,
    TOKENIZER_VOCAB_SIZE,
    Stack,
    assert_idle,
    byte_level_tokenizer,
    collect,
    executor_argv,
    free_port,
    running_stack,
)

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_level_tokenizer().to_str()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_json, CHATML_TEMPLATE, None, (EOS_ID,))


@pytest.fixture(scope="module", params=[1, 5], ids=["single-step", "multi-step"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str):
    """The echo stack; again with 5 decode steps per plan, so stops land inside a plan (blocks hold 4 tokens)."""
    files = tmp_path_factory.mktemp("echo-files")
    (files / "tokenizer.json").write_text(tokenizer_json)
    (files / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    port = free_port()
    options = dict(
        num_blocks=128, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
        eos_token_ids=EOS_ID, tokenizer_json=files / "tokenizer.json", chat_template=files / "chat_template.jinja",
    )
    with running_stack(executor_argv("echo", port, options), tmp_path_factory.mktemp("echo-stack"),
                       executor_port=port, num_scheduler_steps=request.param) as s:
        yield s


@pytest.fixture
def idle_after(stack: Stack):
    """Every test here ends with no request left, every block free and nothing held by the executor."""
    yield
    assert_idle(stack.stub)
    assert stack.executor_reset() == 0


def text_request(text: str, max_tokens: int | None = None, **stopping: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text=text, stopping=pb.StoppingOptions(**stopping))
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    return request


@pytest.mark.usefixtures("idle_after")
@pytest.mark.parametrize("text", ["日本語 🦀 crab, héllo wörld", "🦀🦀🦀", "plain"])
def test_multibyte_text_streams_back_without_partial_characters(stack: Stack, tokenizer: ModelTokenizer, text: str):
    ids = tokenizer.encode(text)
    responses = list(stack.stub.Generate(text_request(text, len(ids))))
    got = collect(responses)
    assert got.text == text
    assert got.token_ids == ids
    assert not any(REPLACEMENT_CHAR in r.text for r in responses)
    assert got.finish_reason == pb.FINISH_REASON_LENGTH
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(ids))


@pytest.mark.usefixtures("idle_after")
@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world, héllo wörld!", ["o w"], "Hell"),
        ("日本語 🦀 crab", ["🦀 c"], "日本語 "),
        ("The quick brown fox jumps.", ["fox", "quick"], "The "),
        ("héllo wörld", ["ö"], "héllo w"),
    ],
)
def test_stop_strings_spanning_tokens_end_the_stream_and_are_not_returned(
    stack: Stack, tokenizer: ModelTokenizer, text: str, stop: list[str], expected: str
):
    ids = tokenizer.encode(text)
    got = collect(list(stack.stub.Generate(text_request(text, len(ids), stop=stop))))
    assert got.text == expected
    assert got.finish_reason == pb.FINISH_REASON_STOP
    assert got.token_ids == ids[: len(got.token_ids)]
    assert got.usage.completion_tokens == len(got.token_ids) <= len(ids)
    matched = next(s for s in stop if text.startswith(s, len(expected)))
    assert tokenizer.decode(got.token_ids).startswith(expected + matched), "generation ended before the stop string"


@pytest.mark.usefixtures("idle_after")
def test_text_that_only_looked_like_a_stop_string_is_returned_at_the_end(stack: Stack, tokenizer: ModelTokenizer):
    text = "abc ST"
    got = collect(list(stack.stub.Generate(text_request(text, len(tokenizer.encode(text)), stop=["STOP"]))))
    assert (got.text, got.finish_reason) == (text, pb.FINISH_REASON_LENGTH)


@pytest.mark.usefixtures("idle_after")
def test_a_stop_token_ends_the_stream_and_is_not_returned_as_text(stack: Stack, tokenizer: ModelTokenizer):
    text = "Hello world, héllo wörld!"
    ids = tokenizer.encode(text)
    k = 3
    got = collect(list(stack.stub.Generate(text_request(text, len(ids), stop_token_ids=[ids[k]]))))
    assert got.token_ids == ids[: k + 1]
    assert got.text == tokenizer.decode(ids[:k])
    assert got.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.usefixtures("idle_after")
def test_eos_stops_unless_ignored(stack: Stack):
    text = "ab<|endoftext|>cd"
    stopped = stack.stub.GenerateOnce(text_request(text, 4))
    assert (stopped.text, stopped.finish_reason) == ("ab", pb.FINISH_REASON_STOP)
    assert stopped.token_ids[-1] == EOS_ID
    ignored = stack.stub.GenerateOnce(text_request(text, 4, ignore_eos=True))
    assert (ignored.text, ignored.finish_reason) == ("abc", pb.FINISH_REASON_LENGTH)
    assert ignored.usage.completion_tokens == 4


@pytest.mark.usefixtures("idle_after")
def test_max_tokens_defaults_to_the_room_left_under_the_model_length(stack: Stack, tokenizer: ModelTokenizer):
    text = "The quick brown fox jumps. " * 6
    num_prompt = len(tokenizer.encode(text))
    assert MAX_MODEL_LEN - 30 < num_prompt < MAX_MODEL_LEN
    response = stack.stub.GenerateOnce(pb.GenerateRequest(text=text))
    assert response.usage.completion_tokens == MAX_MODEL_LEN - num_prompt
    assert response.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.usefixtures("idle_after")
def test_chat_is_rendered_with_the_template(stack: Stack, tokenizer: ModelTokenizer):
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "héllo 🦀")]
    prompt_ids = tokenizer.encode_chat(messages)
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role=m.role, content=m.content) for m in messages])
    stopping = pb.StoppingOptions(max_tokens=len(prompt_ids))
    response = stack.stub.GenerateOnce(pb.GenerateRequest(chat=chat, stopping=stopping))
    # The echo returns the rendered prompt; its special tokens are not shown as text.
    assert response.text == "system\nBe brief.\nuser\nhéllo 🦀\nassistant\n"
    assert response.usage.prompt_tokens == len(prompt_ids)
    chat.add_generation_prompt = False
    without = stack.stub.GenerateOnce(pb.GenerateRequest(chat=chat, stopping=pb.StoppingOptions(max_tokens=3)))
    assert without.usage.prompt_tokens < len(prompt_ids)


@pytest.mark.usefixtures("idle_after")
def test_an_unknown_chat_role_is_refused_by_name(stack: Stack):
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="robot")])
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.GenerateOnce(pb.GenerateRequest(chat=chat))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[1].role" in e.value.details() and "'robot'" in e.value.details()


@pytest.mark.usefixtures("idle_after")
def test_the_prefix_cache_serves_a_repeated_prompt(stack: Stack, tokenizer: ModelTokenizer):
    text = "Pack my box with five dozen liquor jugs."
    num_prompt = len(tokenizer.encode(text))
    first = stack.stub.GenerateOnce(text_request(text, 2))
    second = stack.stub.GenerateOnce(text_request(text, 2))
    assert first.usage.cached_prompt_tokens == 0
    assert 0 < second.usage.cached_prompt_tokens < num_prompt
    assert second.usage.cached_prompt_tokens % 4 == 0, "whole blocks only"
    assert second.text == first.text


def test_model_info_reports_the_tokenizer_and_template(stack: Stack):
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.has_tokenizer and info.has_chat_template
    assert info.model_id == "echo" and info.vocab_size == TOKENIZER_VOCAB_SIZE


def test_logs_stay_quiet_while_serving(stack: Stack):
    lines = Path(stack.log_dir / "scheduler.log").read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if "executor ready" in line)
    assert lines[ready:] == lines[-1:], f"the scheduler logged while serving: {lines[ready + 1:]}"
