"""``--tool-call-parser pythonic`` (Llama 3.2, Llama 4): the answer is a Python list of calls. On text, whole and
streamed whatever the deltas (the same calls either way, arguments never taken back), text that is no such list as
content; then through the OpenAI API with the real ``openai`` SDK and the echo executor (``test_http_tools``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.api.http.tool_pythonic import PythonicParser, skip_string
from scheduler_svc.config import parse_config
from tests.http_fixtures import Hosted
from tests.test_http_tools import AUTO, TOOLS, answering, serving, streamed_calls
from tests.test_http_tools_parsers import new_id, stream

CALLS = ("[get_weather(city='Zürich', days=[1, 2], unit=\"c\\\"f\"), weather.get_time(tz=-5.5, dst=true, "
         "note=None, at=(1, 2)), noop()]")
EXPECTED = [("get_weather", {"city": "Zürich", "days": [1, 2], "unit": 'c"f'}),
            ("weather.get_time", {"tz": -5.5, "dst": True, "note": None, "at": [1, 2]}), ("noop", {})]


def whole(text: str) -> tuple[list[tuple[str, dict]], str | None]:
    extracted = PythonicParser(new_id).whole(text)
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls], extracted.content


def test_a_list_of_calls_reads_as_vllm_reads_it():
    assert whole(CALLS) == (EXPECTED, None)
    assert whole("[f('positional', x=1)]") == ([("f", {"x": 1})], None), "positional arguments are left out"
    assert whole("[f(s={'a', 'b'} )]")[0][0][1]["s"] in (["a", "b"], ["b", "a"]), "a set is a list"
    calls = PythonicParser(new_id).whole(CALLS).calls
    assert calls[0].arguments == '{"city": "Zürich", "days": [1, 2], "unit": "c\\"f"}', "vLLM's JSON, non-ASCII kept"


@pytest.mark.parametrize("text", ["It is sunny.", "[1, 2]", "[]", "[f(a=g(1))]", "[f(a=1)] and then", " [f(a=1)]",
                                  "[f(a=b)]", "[f(a=1), 'x']"])
def test_an_answer_that_is_no_list_of_calls_is_content(text: str):
    assert whole(text) == ([], text)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 200])
def test_streamed_calls_are_the_whole_ones_whatever_the_deltas(size: int):
    content, calls = stream(PythonicParser(new_id), CALLS, size)
    assert content == ""
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == EXPECTED
    assert [arguments for _, arguments in calls.values()] == [c.arguments for c in PythonicParser(new_id).whole(
        CALLS).calls], "the same JSON text"


@pytest.mark.parametrize("text", [
    "[f(x=1, y=2,)]", "[f(\n  x=1,\n  y='a',\n)]", "[f(x=1),]", "[\n  f(x=1),\n  g(y=2),\n]", "[f (x=1)]",
    "[ f ( x = 1 ) ]", "[f(x='\\12')]", "[f(x='\\123z')]", "[f(x='\\x41\\u00e9\\N{LATIN SMALL LETTER A}')]",
    "[f(x='a\\\\b', y=\"it's\")]", "[\ufb01le(x=1)]", "[f(x=1)];", "[f(x={'k': [1, {'j': None}]})]"])
def test_valid_python_streams_as_it_reads_whole(text: str):
    """Trailing commas, spaces, escapes that may still grow (an octal one), names Python normalizes: the same calls
    and the same JSON text whatever the deltas, never a piece taken back."""
    expected = [(c.name, c.arguments) for c in PythonicParser(new_id).whole(text).calls]
    assert expected
    for size in (1, 2, 3, len(text)):
        content, calls = stream(PythonicParser(new_id), text, size)
        assert (content, [tuple(call) for call in calls.values()]) == ("", expected), size


def test_what_json_cannot_hold_is_no_call():
    for text in ("[f(x={b'a': 1})]", "[f(x={...: 1})]", "[f(x=1, x=2)]", "[f(x=b'a')]"):
        assert whole(text) == ([], text)


def test_arguments_go_out_as_far_as_they_are_settled():
    parser = PythonicParser(new_id)
    first = parser.feed("[get_weather(")
    assert [(c.function.name, c.function.arguments) for c in first.calls] == [("get_weather", None), (None, "{")]
    assert parser.feed("days=1") is None, "a number may go on"
    assert parser.feed("2, city='Zü").calls[0].function.arguments == '"days": 12, "city": "Zü'
    assert parser.feed("\\") is None, "an escape not finished"
    assert parser.feed("'ri").calls[0].function.arguments == "'ri"
    assert parser.feed("ch')]").calls[0].function.arguments == 'ch"}'


@pytest.mark.parametrize("text", ["It is [sunny].", "[1, 2] are numbers", "[Link](https://example.com)"])
def test_streamed_text_that_is_no_list_of_calls_is_content_held_back_nothing(text: str):
    for size in (1, 3):
        assert stream(PythonicParser(new_id), text, size) == (text, {})


def test_the_flag_takes_vllms_name():
    assert parse_config(["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"], {}).tool_call_parser == \
        "pythonic"


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def pythonic_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({**AUTO, "NANOSERVE_TOOL_CALL_PARSER": "pythonic"}, request.param) as h:
        yield h


def test_pythonic_calls_whole_and_streamed(pythonic_api: Hosted):
    client = pythonic_api.openai()
    answer = "[get_weather(city='Paris', days=3), get_time()]"
    reply = client.chat.completions.create(**answering(answer, tools=TOOLS))
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    expected = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    content, calls, finishes = streamed_calls(list(client.chat.completions.create(
        **answering(answer, tools=TOOLS, stream=True))))
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == expected
    assert content == "" and finishes[-1] == "tool_calls"
    plain = client.chat.completions.create(**answering("It is [sunny].", tools=TOOLS))
    assert (plain.choices[0].message.content, plain.choices[0].finish_reason) == ("It is [sunny].", "stop")
    assert streamed_calls(list(client.chat.completions.create(
        **answering("It is [sunny].", tools=TOOLS, stream=True))))[:2] == ("It is [sunny].", {})
    pythonic_api.assert_idle()


def char_by_char_skip(text: str, i: int) -> int:
    """The scan ``skip_string`` replaced, a Python step a character: its answers are the rule."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    j = i + len(quote)
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith(quote, j):
            return j + len(quote)
        else:
            j += 1
    return len(text)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["'", '"']), st.text(alphabet="'\"\\ab\n", max_size=14))
def test_a_string_literal_ends_where_the_character_scan_said(quote: str, rest: str):
    text = quote + rest
    assert min(skip_string(text, 0), len(text)) == min(char_by_char_skip(text, 0), len(text))
