"""Anthropic's Messages API (``/v1/messages``) through the real ``anthropic`` SDK, whose stream helper builds the
message from the events (each block started before its deltas). As in ``test_http_responses``, the echo executor
answers with the conversation the template saw (``CONVERSATION``), or, under the reasoning and tool parsers, with
the last message: each message is the chat completion of the same conversation, in Anthropic's blocks, stop reasons
and usage. Errors come in Anthropic's shape. Served by the scheduler and by its API process alike."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.http_fixtures import Hosted
from tests.test_http_reasoning import QWEN3, THOUGHT
from tests.test_http_responses import CALL, CONVERSATION
from tests.test_http_tools import AUTO, CALL_ID, serving

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def plain_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({}, request.param, template=CONVERSATION) as h:
        yield h


@pytest.fixture
def api(plain_api: Hosted) -> Iterator[Hosted]:
    yield plain_api
    plain_api.assert_idle()


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def parsing_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({**QWEN3, **AUTO, "NANOSERVE_TOOL_CALL_PARSER": "hermes"}, request.param) as h:
        yield h


@pytest.fixture
def parsed(parsing_api: Hosted) -> Iterator[Hosted]:
    yield parsing_api
    parsing_api.assert_idle()


def client(api: Hosted) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.url, api_key="none", max_retries=0)


def streamed(api: Hosted, **request: object) -> tuple[list[str], anthropic.types.Message]:
    with client(api).messages.stream(model="tools", **request) as stream:
        kinds = [event.type for event in stream]
        return kinds, stream.get_final_message()


def test_a_message_is_the_chat_completion_of_its_conversation(api: Hosted):
    reply = client(api).messages.create(model="tools", max_tokens=100, system="Be brief.",
                                        messages=[{"role": "user", "content": "Hi"}])
    chat = api.openai().chat.completions.create(model="tools", messages=[{"role": "system", "content": "Be brief."},
                                                                         {"role": "user", "content": "Hi"}])
    assert [block.type for block in reply.content] == ["text"] and reply.id.startswith("msg_")
    assert reply.content[0].text == chat.choices[0].message.content == "system:Be brief.;user:Hi;"
    assert (reply.stop_reason, reply.stop_sequence, reply.role, reply.model) == ("end_turn", None, "assistant", "tools")
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    kinds, final = streamed(api, max_tokens=100, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == reply.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == usage.output_tokens


def test_blocks_become_the_conversation_vllm_renders(api: Hosted):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Paris.", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And?"}]}]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "Rules."}]
    reply = client(api).messages.create(model="tools", max_tokens=200, system=system, messages=messages,
                                        tools=[WEATHER], tool_choice={"type": "none"})
    assert reply.content[0].text == ('T=get_weather;system:Rules.;user:Weather?;assistant:~Paris.'
                                     '[get_weather{"city": "Paris"}#toolu_1];tool:sunny@toolu_1;user:And?;')
    count = client(api).messages.count_tokens(model="tools", system=system, messages=messages, tools=[WEATHER],
                                              tool_choice={"type": "none"})
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_stop_sequences_and_max_tokens_say_why_the_message_stopped(api: Hosted):
    stopped = client(api).messages.create(model="tools", max_tokens=100, stop_sequences=["there"],
                                          messages=[{"role": "user", "content": "Hi there"}])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "user:Hi ", "stop_sequence", "there")
    cut = client(api).messages.create(model="tools", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    kinds, final = streamed(api, max_tokens=100, stop_sequences=["there"],
                            messages=[{"role": "user", "content": "Hi there"}])
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == ("user:Hi ", "stop_sequence", "there")


def test_thinking_is_a_thinking_block_and_calls_are_tool_use(parsed: Hosted):
    chat = parsed.openai().chat.completions.create(model="tools", messages=[{"role": "user", "content": THOUGHT}])
    reply = client(parsed).messages.create(model="tools", max_tokens=200,
                                           messages=[{"role": "user", "content": THOUGHT}])
    thinking, text = reply.content
    assert (thinking.type, thinking.thinking, text.text) == (
        "thinking", chat.choices[0].message.reasoning, chat.choices[0].message.content)
    assert thinking.signature
    kinds, final = streamed(parsed, max_tokens=200, messages=[{"role": "user", "content": THOUGHT}])
    assert "signature" in kinds and [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking.thinking and final.content[1].text == text.text
    off = client(parsed).messages.create(model="tools", max_tokens=200, thinking={"type": "disabled"},
                                         messages=[{"role": "user", "content": THOUGHT}])
    assert [block.type for block in off.content] == ["text"]  # the template's thinking off: all of it is text

    for reply in (client(parsed).messages.create(model="tools", max_tokens=200, tools=[WEATHER],
                                                 messages=[{"role": "user", "content": "</think>\n\n" + CALL}]),
                  streamed(parsed, max_tokens=200, tools=[WEATHER],
                           messages=[{"role": "user", "content": "</think>\n\n" + CALL}])[1]):
        (call,) = reply.content
        assert (call.type, call.name, call.input, reply.stop_reason) == (
            "tool_use", "get_weather", {"city": "Paris"}, "tool_use")
        assert CALL_ID.fullmatch(call.id)


@pytest.mark.parametrize(("body", "status", "kind", "says"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type: content blocks of type 'image'"),
    ({"max_tokens": 100_000, "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error",
     "max_tokens: prompt of"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}], "model": "nope"}, 404, "not_found_error",
     "The model `nope` does not exist"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "tool_choice.name"),
])
def test_errors_come_in_anthropics_shape(api: Hosted, body: dict, status: int, kind: str, says: str):
    answer = httpx.post(f"{api.url}/v1/messages", json={"model": "tools", **body}, timeout=30)
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"].startswith(says)
    openai_shaped = httpx.post(f"{api.url}/v1/chat/completions", json={"model": "tools"}, timeout=30).json()
    assert openai_shaped["error"]["param"] == "messages"  # other routes keep OpenAI's


@pytest.fixture(scope="module")
def echo_api() -> Iterator[Hosted]:
    """No parsers: the answer is the last message (a forced call's, as the test writes it)."""
    with serving({}) as h:
        yield h


def test_a_forced_call_cut_by_a_stop_sequence_is_no_tool_use_whole_or_streamed(echo_api: Hosted):
    request = {"max_tokens": 100, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
               "messages": [{"role": "user", "content": '{"city": "Paris"}'}]}
    done = client(echo_api).messages.create(model="tools", **request)
    assert (done.content[0].input, done.stop_reason) == ({"city": "Paris"}, "tool_use")
    for reply in (client(echo_api).messages.create(model="tools", stop_sequences=["Paris"], **request),
                  streamed(echo_api, stop_sequences=["Paris"], **request)[1]):
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Paris")
    echo_api.assert_idle()


def test_a_lone_surrogate_in_a_calls_arguments_is_answered(parsed: Hosted):
    answer = '</think><tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'
    reply = client(parsed).messages.create(model="tools", max_tokens=200, tools=[WEATHER],
                                           messages=[{"role": "user", "content": answer}])
    assert reply.content[0].input == {"city": "\ud800"}


def test_count_tokens_first_needs_no_other_request_and_knows_the_models():
    with serving({}) as h:  # the API process learns the tokenizer when asked
        counted = client(h).messages.count_tokens(model="tools", messages=[{"role": "user", "content": "Hi"}])
        chat = h.openai().chat.completions.create(model="tools", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=1)
        assert counted.input_tokens == chat.usage.prompt_tokens
        with pytest.raises(anthropic.NotFoundError):
            client(h).messages.count_tokens(model="nope", messages=[{"role": "user", "content": "Hi"}])


def test_the_api_key_is_taken_in_either_header_and_refused_in_anthropics_shape():
    with serving({"NANOSERVE_API_KEY": "secret"}) as h:
        refused = httpx.post(f"{h.url}/v1/messages", json={"model": "tools", "max_tokens": 5, "messages": []})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        for keyed in (anthropic.Anthropic(base_url=h.url, auth_token="secret", max_retries=0),  # Bearer, as vLLM
                      anthropic.Anthropic(base_url=h.url, api_key="secret", max_retries=0)):  # x-api-key
            assert keyed.messages.create(model="tools", max_tokens=5,
                                         messages=[{"role": "user", "content": "Hi"}]).id
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=h.url, api_key="wrong", max_retries=0).messages.create(
                model="tools", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
        wrong_route = httpx.post(f"{h.url}/v1/chat/completions", json={}, headers={"x-api-key": "secret"})
        assert wrong_route.status_code == 401  # elsewhere the key is OpenAI's Bearer header alone
        assert httpx.post(f"{h.url}/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"
