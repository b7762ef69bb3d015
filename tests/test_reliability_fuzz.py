"""Random, extreme and malformed Generate requests against the real processes: answered, never a crash, no leak."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    TOKENIZER_VOCAB_SIZE,
    Stack,
    assert_idle,
    byte_level_tokenizer,
    executor_argv,
    free_port,
    running_stack,
)

UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shadow executor with a tokenizer and a chat template, so text, chat and stop strings are all reachable."""
    folder: Path = tmp_path_factory.mktemp("fuzz")
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "template.jinja").write_text(CHATML_TEMPLATE)
    options = {"vocab_size": TOKENIZER_VOCAB_SIZE, "tokenizer_json": folder / "tokenizer.json",
               "chat_template": folder / "template.jinja", "max_model_len": 256, "num_blocks": 256, "block_size": 4}
    port = free_port()
    with running_stack(executor_argv("shadow", port, options), folder / "logs", executor_port=port,
                       max_queued_tokens=4096) as s:
        yield s
        assert s.scheduler.poll() is None, "the scheduler crashed"
        assert_idle(s.stub)
        assert s.executor_reset() == 0, "the executor still held requests"


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


# Each field's strategy for a request meant to be valid, and for one that is anything a client could send.
VALID = {
    "temperature": st.floats(0, 2), "top_k": st.integers(0, 100), "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1), "seed": UINT64, "logprobs": st.integers(0, 20), "max_tokens": st.integers(1, 64),
    "token_id": st.integers(0, TOKENIZER_VOCAB_SIZE - 1), "role": st.sampled_from(["user", "system", "assistant"]),
}
WILD = {
    "temperature": FLOATS, "top_k": UINT32, "top_p": FLOATS, "min_p": FLOATS, "seed": UINT64, "logprobs": UINT32,
    "max_tokens": UINT32, "token_id": UINT32, "role": st.text(max_size=20),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Half meant to be valid (so generation, stop strings and chat run), half anything at all."""
    fields = draw(st.sampled_from([VALID, WILD]))
    request = pb.GenerateRequest()
    request_id = draw(optional(st.text(max_size=300)))
    if request_id is not None:
        request.request_id = request_id
    kind = draw(st.sampled_from(["none", "text", "chat", "tokens"]))
    if kind == "text":
        request.text = draw(st.text(max_size=3000) | st.sampled_from(["", " ", "<|im_end|>", "\x00", "🎉" * 50]))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(fields["role"], st.text(max_size=200)), max_size=8)):
            request.chat.messages.add(role=role, content=content)
        generation_prompt = draw(optional(st.booleans()))
        if generation_prompt is not None:
            request.chat.add_generation_prompt = generation_prompt
    elif kind == "tokens":
        request.tokens.token_ids.extend(draw(st.lists(fields["token_id"], max_size=400)))
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs"):
        value = draw(optional(fields[name]))
        if value is not None:
            setattr(request.sampling, name, value)
    max_tokens = draw(optional(fields["max_tokens"]))
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    request.stopping.stop.extend(draw(st.lists(st.text(max_size=30), max_size=300)))
    request.stopping.stop_token_ids.extend(draw(st.lists(fields["token_id"], max_size=300)))
    ignore_eos = draw(optional(st.booleans()))
    if ignore_eos is not None:
        request.stopping.ignore_eos = ignore_eos
    add_special_tokens = draw(optional(st.booleans()))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


GIANT_STOP_LIST = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[5, 6, 7]),
                                     stopping=pb.StoppingOptions(max_tokens=20, stop=[f"s{i}" for i in range(20_000)]))


@settings(FUZZ, max_examples=300)
@given(request=generate_requests())
@example(request=GIANT_STOP_LIST)
def test_any_generate_request_is_answered_ok_or_refused_with_a_reason(stack: Stack, request: pb.GenerateRequest):
    try:
        response = stack.stub.GenerateOnce(request, timeout=30)
    except grpc.RpcError as e:
        event(e.code().name)
        assert e.code() in ANSWERS, f"{e.code()}: {e.details()}"
        assert e.details(), "a refusal must say why"
        return
    event("OK")
    assert response.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert response.usage.completion_tokens == len(response.token_ids) >= 1


@settings(FUZZ, max_examples=60)
@given(payload=st.binary(max_size=2000))
def test_arbitrary_bytes_never_take_the_server_down(stack: Stack, payload: bytes):
    generate_once = stack.channel.unary_unary("/nanoserve.v1.Generation/GenerateOnce")
    try:
        generate_once(payload, timeout=30)
        event("OK")
    except grpc.RpcError as e:
        event(e.code().name)
        assert e.code() in ANSWERS, f"{e.code()}: {e.details()}"
    assert stack.scheduler.poll() is None
