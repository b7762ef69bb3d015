"""OpenAI's Responses API (``/v1/responses``) through the real ``openai`` SDK, whose stream helper checks every
event's place (items opened before their deltas, closed before ``response.completed``). The echo executor answers
with the template's first part: here the whole conversation as the template saw it (``CONVERSATION``), so a test
reads what the input items became; under the reasoning and tool parsers, the last message (``test_http_tools``), so
a test writes the model's answer. Each answer is the chat completion the same conversation gets: the same text,
thinking, calls and token counts. Served by the scheduler and by its API process alike."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from common.step import StepPlan, StepResult
from executor_svc.fakes.shadow_server import EchoExecutor
from scheduler_svc.api.http.responses_api import output
from tests.http_fixtures import Hosted, hosted
from tests.test_http_reasoning import QWEN3, THOUGHT
from tests.test_http_tools import AUTO, CALL_ID, echo_last, serving

# Each message as role:content, its thinking after ~, its calls in [], a tool result's call after @.
CONVERSATION = (
    "{% for t in tools or [] %}T={{ t.function.name }};{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}{% if m.reasoning %}~{{ m.reasoning }}{% endif %}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}{{ c.function.arguments | tojson }}#{{ c.id }}]"
    "{% endfor %}{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %};{% endfor %}<|endoftext|>")
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


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


def streamed(client: openai.OpenAI, **request: object) -> tuple[list, openai.types.responses.Response]:
    with client.responses.stream(model="tools", **request) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_a_response_is_the_chat_completion_of_its_conversation(api: Hosted):
    client = api.openai()
    reply = client.responses.create(model="tools", input="Hi", instructions="Be brief.")
    chat = client.chat.completions.create(model="tools", messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}])
    assert reply.output_text == chat.choices[0].message.content == "system:Be brief.;user:Hi;"
    assert reply.status == "completed" and reply.id.startswith("resp_") and reply.model == "tools"
    assert [item.type for item in reply.output] == ["message"] and reply.output[0].id.startswith("msg_")
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and reply.instructions == "Be brief."


def test_a_streamed_response_opens_each_item_sends_its_deltas_and_closes_it(api: Hosted):
    events, final = streamed(api.openai(), input="Hi")
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == "user:Hi;" and final.status == "completed"
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_input_items_become_the_conversation_vllm_renders(api: Hosted):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    reply = api.openai().responses.create(model="tools", input=items, tools=[WEATHER], tool_choice="none")
    assert reply.output_text == ('T=get_weather;user:Weather?;assistant:[get_weather{"city": "Paris"}#c1];'
                                 "tool:sunny@c1;")
    assert reply.tools[0].name == "get_weather" and reply.tool_choice == "none"


def test_a_stored_response_is_continued_and_retrieved(api: Hosted):
    client = api.openai()
    first = client.responses.create(model="tools", input="Hi", instructions="Rules.")
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="tools", previous_response_id=first.id, input="Again")
    assert second.output_text == f"user:Hi;assistant:{first.output_text};user:Again;"  # instructions don't carry
    third = client.responses.create(model="tools", previous_response_id=second.id, input="More", store=False)
    assert third.output_text.startswith(second.output_text) and third.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(third.id)
    assert missing.value.body["param"] == "response_id"


def test_max_output_tokens_leaves_the_response_incomplete(api: Hosted):
    reply = api.openai().responses.create(model="tools", input="Hello there", max_output_tokens=3)
    assert (reply.status, reply.incomplete_details.reason, reply.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    events, final = streamed(api.openai(), input="Hello there", max_output_tokens=3)
    assert events[-1].type == "response.completed" and final.status == "incomplete"  # vLLM's last event
    assert final.output_text == reply.output_text


def test_max_output_tokens_past_the_room_is_the_room_as_on_vllm(api: Hosted):
    """vLLM's Responses API caps max_output_tokens to what the model's length leaves (its chat route refuses)."""
    reply = api.openai().responses.create(model="tools", input="Hi", max_output_tokens=100_000,
                                          extra_body={"ignore_eos": True})
    assert reply.status == "incomplete" and reply.usage.total_tokens == 2048  # the echo model's length
    refused = api.openai().chat.completions.create
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum length"):
        refused(model="tools", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=100_000)


def test_the_conversation_carries_its_messages_but_not_its_instructions(api: Hosted):
    client = api.openai()
    items = [{"role": "developer", "content": "In French."}, {"role": "user", "content": "Hi"}]
    first = client.responses.create(model="tools", instructions="Rules.", input=items,
                                    extra_body={"request_id": "resp_mine"})
    assert first.id == "resp_mine" and first.output_text == "system:Rules.;system:In French.;user:Hi;"
    second = client.responses.create(model="tools", previous_response_id="resp_mine", input="Again")
    assert second.output_text == f"system:In French.;user:Hi;assistant:{first.output_text};user:Again;"


def test_logprobs_come_with_the_text_when_included(api: Hosted):
    client = api.openai()
    reply = client.responses.create(model="tools", input="Hi", include=["message.output_text.logprobs"],
                                    top_logprobs=1)
    chat = client.chat.completions.create(model="tools", messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=1)
    expected = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    got = reply.output[0].content[0].logprobs
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in got] == expected
    assert client.responses.create(model="tools", input="Hi").output[0].content[0].logprobs is None


def test_thinking_is_a_reasoning_item_and_calls_are_function_calls(parsed: Hosted):
    client = parsed.openai()
    chat = client.chat.completions.create(model="tools", messages=[{"role": "user", "content": THOUGHT}])
    reply = client.responses.create(model="tools", input=THOUGHT)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == chat.choices[0].message.reasoning and reply.output[0].id.startswith("rs_")
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.usage.output_tokens_details.reasoning_tokens ==
            chat.usage.completion_tokens_details.reasoning_tokens > 0)
    events, final = streamed(client, input=THOUGHT)
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reply.output[0].content[0].text and final.output_text == reply.output_text
    assert "response.reasoning_text.delta" in {event.type for event in events}
    hidden = client.responses.create(model="tools", input=THOUGHT, extra_body={"include_reasoning": False})
    assert [item.type for item in hidden.output] == ["message"]

    answer = "<think>\nA call.\n</think>\n\n" + CALL
    for reply in (client.responses.create(model="tools", input=answer, tools=[WEATHER]),
                  streamed(client, input=answer, tools=[WEATHER])[1]):
        thinking, call = reply.output
        assert thinking.type == "reasoning" and call.type == "function_call" and call.status == "completed"
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert CALL_ID.fullmatch(call.call_id) and call.id.startswith("fc_")


def test_blanks_before_a_call_are_no_message_but_alone_they_are(parsed: Hosted):
    """Streamed, blank text is held back until it is known whether a call follows, as the whole answer reads it."""
    client = parsed.openai()
    for answer, kinds in (("</think>\n\n" + CALL, ["function_call"]), ("</think>\n\n", ["message"])):
        whole = client.responses.create(model="tools", input=answer, tools=[WEATHER])
        events, final = streamed(client, input=answer, tools=[WEATHER])
        assert [item.type for item in whole.output] == [item.type for item in final.output] == kinds
        assert final.output_text == whole.output_text


def test_one_call_when_parallel_calls_are_off(parsed: Hosted):
    two = "</think>" + CALL + CALL.replace("Paris", "Rome")
    client = parsed.openai()
    assert len(client.responses.create(model="tools", input=two, tools=[WEATHER]).output) == 2
    for reply in (client.responses.create(model="tools", input=two, tools=[WEATHER], parallel_tool_calls=False),
                  streamed(client, input=two, tools=[WEATHER], parallel_tool_calls=False)[1]):
        assert [json.loads(item.arguments) for item in reply.output] == [{"city": "Paris"}]


def test_a_background_response_is_queued_and_retrieved_done(api: Hosted):
    client = api.openai()
    queued = client.responses.create(model="tools", input="Later", background=True)
    assert queued.status == "queued" and queued.background is True
    deadline = time.monotonic() + 30
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert (done.status, done.output_text) == ("completed", "user:Later;")
    with pytest.raises(openai.BadRequestError, match="already completed"):
        client.responses.cancel(queued.id)
    first = client.responses.create(model="tools", input="Now")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(first.id)


def sse(lines: Iterator[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


def test_a_background_stream_is_read_again_from_any_event(api: Hosted):
    body = {"model": "tools", "input": "Replay me", "background": True, "stream": True}
    with httpx.stream("POST", f"{api.url}/v1/responses", json=body, timeout=30) as answer:
        events = sse(answer.iter_lines())
    assert events[-1]["type"] == "response.completed"
    response_id = events[0]["response"]["id"]
    again = httpx.get(f"{api.url}/v1/responses/{response_id}", params={"stream": "true", "starting_after": 2},
                      timeout=30)
    assert sse(again.iter_lines()) == events[3:]
    assert api.openai().responses.retrieve(response_id).output_text == "user:Replay me;"
    refused = httpx.get(f"{api.url}/v1/responses/{response_id}", params={"stream": "true"})
    assert refused.status_code == 200  # a background stream: all of it again
    plain = api.openai().responses.create(model="tools", input="x")
    refused = httpx.get(f"{api.url}/v1/responses/{plain.id}", params={"stream": "true"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


class SlowEcho(EchoExecutor):
    """Steps of 20 ms: a background response is still working when it is cancelled."""

    def step(self, plan: StepPlan) -> StepResult:
        time.sleep(0.02)
        return super().step(plan)


def test_a_cancelled_background_response_stops_and_frees_its_blocks():
    slow = echo_last(CONVERSATION)
    with hosted(SlowEcho(slow.info)) as h:
        client = h.openai()
        queued = client.responses.create(model="tools", input="Long", background=True, max_output_tokens=500,
                                         extra_body={"ignore_eos": True})
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        time.sleep(0.2)
        assert client.responses.retrieve(queued.id).status == "cancelled"
        h.assert_idle()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"type": "file_search_call"}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "temperature": -1}, 400, "temperature"),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "model": "nope"}, 404, "model"),
    ({"input": 3}, 400, "input"),
])
def test_bad_requests_are_refused_naming_the_parameter(api: Hosted, body: dict, status: int, param: str):
    answer = httpx.post(f"{api.url}/v1/responses", json={"model": "tools", **body}, timeout=30)
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
    assert httpx.post(f"{api.url}/v1/responses/resp_missing/cancel").status_code == 404


def test_a_server_that_keeps_nothing_says_so():
    with hosted(echo_last(CONVERSATION), responses_store=0) as h:
        client = h.openai()
        reply = client.responses.create(model="tools", input="Hi")
        assert reply.store is False and reply.output_text == "user:Hi;"
        with pytest.raises(openai.NotFoundError, match="--responses-store"):
            client.responses.create(model="tools", input="x", previous_response_id=reply.id)
        with pytest.raises(openai.BadRequestError, match="--responses-store"):
            client.responses.create(model="tools", input="x", background=True)
        h.assert_idle()


@pytest.fixture
def in_scheduler() -> Iterator[Hosted]:
    """In the test's own process, where a fault can be planted in the route's code."""
    with hosted(echo_last(CONVERSATION), api_process=False) as h:
        yield h
        h.assert_idle()


def test_a_fault_in_background_work_fails_the_response_instead_of_hanging(in_scheduler: Hosted,
                                                                         monkeypatch: pytest.MonkeyPatch):
    def fault(*args: object) -> None:
        raise RuntimeError("planted")

    client = in_scheduler.openai()
    monkeypatch.setattr(output, "output_items", fault)
    queued = client.responses.create(model="tools", input="x", background=True)
    deadline = time.monotonic() + 30
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert done.status == "failed" and "the server failed" in done.error.message
    monkeypatch.setattr(output, "logprobs_of", fault)
    body = {"model": "tools", "input": "x", "background": True, "stream": True}
    with httpx.stream("POST", f"{in_scheduler.url}/v1/responses", json=body, timeout=30) as answer:
        events = sse(answer.iter_lines())
    assert events[-1]["type"] == "error" and events[-1]["sequence_number"] == len(events) - 1
    assert client.responses.retrieve(events[0]["response"]["id"]).status == "failed"
