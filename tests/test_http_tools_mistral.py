"""``--tool-call-parser mistral``: ``[TOOL_CALLS]`` and Mistral's two forms (a JSON array before its v11 tokenizers,
``name[ARGS]{...}`` from v11 on), whole and streamed whatever the deltas (the same calls either way), Mistral's
nine-character ids on every call; then through the OpenAI API with the real ``openai`` SDK and the echo executor."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from scheduler_svc.api.http.tool_mistral import MistralParser
from tests.http_fixtures import Hosted
from tests.test_http_tools import AUTO, TOOLS, answering, serving, streamed_calls
from tests.test_http_tools_parsers import stream

MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
PRE_V11 = ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}, '
           '{"name": "get_time", "arguments": {}}]')
V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": [1, 2]}[TOOL_CALLS]get_time[ARGS]{}'
EXPECTED = [("get_weather", '{"city": "Zürich", "days": [1, 2]}'), ("get_time", "{}")]


def whole(text: str) -> tuple[list[tuple[str, str]], str | None]:
    extracted = MistralParser().whole(text)
    return [(c.name, c.arguments) for c in extracted.calls], extracted.content


def test_both_forms_read_as_vllm_reads_them():
    assert whole(PRE_V11) == (EXPECTED, "Let me check.")
    assert whole(V11) == (EXPECTED, None)
    assert whole('[TOOL_CALLS][TOOL_CALLS] {"name": "f", "arguments": "{\\"a\\": 1}"}') == (
        [("f", '{"a": 1}')], None), "repeated markers count as one; arguments sent as a string are kept"
    assert whole('[TOOL_CALLS] [{"name": 3}, 7, {"arguments": {"x": 1}}]') == (
        [("", "{}"), ("", '{"x": 1}')], None), "entries that are no call are skipped; a name that is no string is \"\""


def test_the_form_is_told_by_what_follows_the_marker_and_v11_keeps_the_models_text():
    assert whole('[TOOL_CALLS][{"name": "f", "arguments": {"x": "[ARGS]"}}]') == ([("f", '{"x": "[ARGS]"}')], None)
    assert whole('[TOOL_CALLS]f[ARGS]{"x":1.50,"y":"\\u00e9"}') == ([("f", '{"x":1.50,"y":"\\u00e9"}')], None)
    for text in ("[TOOL_CALLS]" + "[" * 3000, "[TOOL_CALLS]f[ARGS]" + "[" * 3000):  # too deep to read: content
        assert whole(text) == ([], text) and stream(MistralParser(), text, 7)[1] in ({}, {0: ["f", ""]})


def test_a_number_that_may_still_grow_waits():
    parser = MistralParser()
    parser.feed("[TOOL_CALLS]f[ARGS]4")
    assert parser.feed("2") is None
    assert parser.feed("[TOOL_CALLS]").calls[0].function.arguments == "42"


@pytest.mark.parametrize("text", ["It is sunny.", "[TOOL_CALLS] hello", '[TOOL_CALLS] [{"name": "f", "argum',
                                  "[TOOL_CALLS] [1, 2]", '[TOOL_CALLS]f[ARGS]{"a": '])
def test_calls_that_do_not_read_leave_the_answer_content(text: str):
    assert whole(text) == ([], text)


@pytest.mark.parametrize("text", [PRE_V11, V11])
@pytest.mark.parametrize("size", [1, 2, 5, 500])
def test_streamed_calls_are_the_whole_ones_whatever_the_deltas(text: str, size: int):
    content, calls = stream(MistralParser(), text, size)
    assert (content, [tuple(call) for call in calls.values()]) == (whole(text)[1] or "", EXPECTED)


def test_what_may_begin_the_marker_waits_and_the_ids_are_mistrals():
    parser = MistralParser()
    assert parser.feed("Hi [TOOL_").content == "Hi "
    assert parser.feed("box]").content == "[TOOL_box]"
    first = parser.feed("[TOOL_CALLS]f[ARGS]")
    assert first is not None and MISTRAL_ID.fullmatch(first.calls[0].id)
    assert all(MISTRAL_ID.fullmatch(MistralParser.call_id()) for _ in range(20))


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def mistral_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({**AUTO, "NANOSERVE_TOOL_CALL_PARSER": "mistral"}, request.param) as h:
        yield h


def test_mistral_calls_whole_and_streamed_with_mistrals_ids(mistral_api: Hosted):
    client = mistral_api.openai()
    reply = client.chat.completions.create(**answering(PRE_V11, tools=TOOLS))
    message = reply.choices[0].message
    assert (message.content, reply.choices[0].finish_reason) == ("Let me check.", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == EXPECTED
    assert all(MISTRAL_ID.fullmatch(c.id) for c in message.tool_calls), "its template takes no other id back"
    content, calls, finishes = streamed_calls(list(client.chat.completions.create(
        **answering(V11, tools=TOOLS, stream=True))))
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == EXPECTED
    assert all(MISTRAL_ID.fullmatch(calls[i]["id"]) for i in (0, 1))
    assert content == "" and finishes[-1] == "tool_calls"
    required = client.chat.completions.create(**answering(json.dumps([{"name": "get_time", "parameters": {}}]),
                                                          tools=TOOLS, tool_choice="required"))
    assert MISTRAL_ID.fullmatch(required.choices[0].message.tool_calls[0].id), "forced calls too"
    mistral_api.assert_idle()
