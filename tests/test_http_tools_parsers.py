"""Tool calling's parts on text: the ``hermes`` and ``llama3_json`` parsers and the forced choices' reading, whole
and streamed (a character at a time, and in one delta: the same calls either way), the schema a forced choice is
held to, vLLM's refusals, partial JSON, and the conversation rendered with tools exactly as transformers renders
what vLLM hands it."""

from __future__ import annotations

import itertools
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from scheduler_svc.api.http import chat_render, forced_calls, partial_json
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.schemas import ChatCompletionRequest
from scheduler_svc.api.http.tool_calls import HermesParser, Llama3JsonParser, Streamed
from scheduler_svc.api.http.tool_mistral import MistralParser
from scheduler_svc.api.http.tool_pythonic import PythonicParser
from scheduler_svc.api.http.tool_request import ToolChoice, forced_schema, tool_choice
from scheduler_svc.api.http.tool_schemas import Tool, ToolCall
from scheduler_svc.api.http.translate import ROLE_ALIASES, message_text
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.test_http_tools import QWEN_TOOLS_TEMPLATE, TOKENIZER, TOOLS

ids = (f"id-{i}" for i in itertools.count())


def new_id() -> str:
    return next(ids)


def stream(parser, text: str, size: int) -> tuple[str, dict[int, list[str]]]:
    """The content and each call's (name, arguments) joined, the text fed ``size`` characters at a time."""
    content, calls = "", {}
    for start in range(0, len(text), size):
        out = parser.feed(text[start:start + size])
        if out is None:
            continue
        if isinstance(out, list):  # the forced choices send calls alone
            out = Streamed(calls=out)
        content += out.content or ""
        for call in out.calls:
            joined = calls.setdefault(call.index, ["", ""])
            joined[0] += call.function.name or ""
            joined[1] += call.function.arguments or ""
    return content, calls


HERMES = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_reads_every_call_and_the_content_before():
    extracted = HermesParser(new_id).whole(HERMES)
    assert extracted.content == "I will look.\n"
    assert [(c.name, c.arguments) for c in extracted.calls] == [
        ("get_weather", '{"city": "Zürich", "days": [1, 2]}'), ("get_time", "{}")]
    unclosed = HermesParser(new_id).whole('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, c.arguments) for c in unclosed.calls] == [("f", '{"a": 1}')] and unclosed.content is None
    for broken in ('x<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f"}</tool_call>'):
        assert HermesParser(new_id).whole(broken).calls == [] and HermesParser(new_id).whole(broken).content == broken


@pytest.mark.parametrize("size", [1, 3, len(HERMES)])
def test_hermes_streams_the_calls_it_reads_whole(size: int):
    content, calls = stream(HermesParser(new_id), HERMES, size)
    assert content == "I will look.\n"
    # arguments as generated (the whole reading re-serializes them: the same JSON here)
    assert calls == {0: ["get_weather", '{"city": "Zürich", "days": [1, 2]}'], 1: ["get_time", "{}"]}


@pytest.mark.parametrize("size", [1, 3, 200])
def test_hermes_streams_arguments_written_before_the_name(size: int):
    """A model may write "arguments" first: they go out once the name is known, without what follows them."""
    text = '<tool_call>\n{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}\n</tool_call>'
    assert stream(HermesParser(new_id), text, size) == ("", {0: ["get_weather", '{"city": "Paris", "days": 2}']})
    assert [(c.name, c.arguments) for c in HermesParser(new_id).whole(text).calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}')]


def test_hermes_holds_back_what_could_be_a_tag():
    parser = HermesParser(new_id)
    assert parser.feed("Hi <tool_").content == "Hi "
    assert parser.feed("box>").content == "<tool_box>"
    assert parser.feed("<tool_call>") is None


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "arguments": {"x": 1}}'


@pytest.mark.parametrize("size", [1, 4, len(LLAMA)])
def test_llama3_json_streams_every_call_whatever_the_deltas(size: int):
    """vLLM's parser takes one step a delta; a delta of several calls (the API process gathers tokens) loses none.
    (<|python_tag|> is one token: it comes whole.)"""
    parser = Llama3JsonParser(new_id)
    assert parser.feed(Llama3JsonParser.BOT) is None
    assert stream(parser, LLAMA.removeprefix(Llama3JsonParser.BOT), size) == (
        "", {0: ["get_weather", '{"city": "Paris"}'], 1: ["f", '{"x": 1}']})
    extracted = Llama3JsonParser(new_id).whole(LLAMA)
    assert [(c.name, c.arguments) for c in extracted.calls] == [("get_weather", '{"city": "Paris"}'), ("f", '{"x": 1}')]


def test_llama3_json_takes_text_that_is_no_call_as_content():
    assert stream(Llama3JsonParser(new_id), "Hello {there", 2) == ("Hello {there", {})
    for text in ("Hello {there", '{"name": "f"}', "plain"):
        assert Llama3JsonParser(new_id).whole(text).calls == [] and Llama3JsonParser(new_id).whole(text).content == text


def test_a_required_array_reads_whole_and_streams_as_generated():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {} }]'
    assert [(c.name, c.arguments) for c in forced_calls.required_calls(text)] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for size in (1, 5, len(text)):
        content, calls = stream(forced_calls.RequiredStream(new_id), text, size)
        assert calls == {0: ["get_weather", '{"city": "Paris"}'], 1: ["get_time", "{}"]}
    assert forced_calls.required_calls('[{"name": 1, "parameters": {}}]') == []
    assert forced_calls.required_calls("not json") == []


def test_a_call_is_announced_once_its_name_closed_and_its_parameters_began():
    stream_ = forced_calls.RequiredStream(new_id)
    assert stream_.feed('[{"name": "get_wea') == []
    assert stream_.feed('ther", "parameters": ') == []
    (first,) = stream_.feed('{"ci')
    assert (first.function.name, first.function.arguments, first.id is not None) == ("get_weather", '{"ci', True)
    (more,) = stream_.feed('ty": "Oslo"}}, {"na')
    assert (more.id, more.function.name, more.function.arguments) == (None, None, 'ty": "Oslo"}')


def test_a_named_call_takes_the_text_as_its_arguments():
    assert [(c.name, c.arguments) for c in forced_calls.named_call("f", '{"a": 1}')] == [("f", '{"a": 1}')]
    assert forced_calls.named_call("f", "  ") == []
    named = forced_calls.NamedStream("f", new_id)
    first, second = named.feed('{"a"'), named.feed(": 1}")
    assert (first[0].function.name, first[0].function.arguments, second[0].function.name) == ("f", '{"a"', None)


def tools(*parameters: dict | None) -> tuple[Tool, ...]:
    return tuple(Tool.model_validate({"function": {"name": f"t{i}", "parameters": p}})
                 for i, p in enumerate(parameters))


def test_the_forced_schemas_are_vllms():
    with_defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}
    schema = forced_schema(ToolChoice("required", tools=tools(with_defs, None), parallel=False))
    assert schema == {"type": "array", "minItems": 1, "maxItems": 1, "$defs": {"P": {"type": "string"}}, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["t0"]},
                            "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["t1"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}
    assert forced_schema(ToolChoice("named", "t1", tools(with_defs, None))) == {"type": "object", "properties": {}}
    assert forced_schema(ToolChoice("named", "t0", tools(with_defs)))["$defs"] == {"P": {"type": "string"}}
    clash = {"$defs": {"P": {"type": "integer"}}}
    with pytest.raises(ApiError, match="Tool definition 'P' has multiple schemas"):
        forced_schema(ToolChoice("required", tools=tools(with_defs, clash)))
    assert forced_schema(ToolChoice("auto", tools=tools(None))) is None


def test_tool_choice_defaults_as_vllm_reads_it():
    given = list(tools(None))
    assert tool_choice(given, None).kind == "auto" and tool_choice(None, None).kind == "none"
    assert tool_choice(given, {"type": "function", "function": {"name": "t0"}}) == ToolChoice("named", "t0",
                                                                                             tuple(given))
    with pytest.raises(ApiError) as refused:
        tool_choice(given, {"function": {"name": 3}})
    assert refused.value.detail.param == "tool_choice" and "Invalid `name` in `function`: `3`" in str(refused.value)


def test_partial_json_reads_as_far_as_the_text_goes():
    assert partial_json.loads('{"name": "get_wea') == ({"name": "get_wea"}, 17)
    assert partial_json.loads('{"name": "get_wea', strings=False) == ({}, 17)
    assert partial_json.loads('{"a": [1, tr') == ({"a": [1, True]}, 12)
    assert partial_json.loads('{"a": 1}; {"b"') == ({"a": 1}, 8)
    with pytest.raises(ValueError):
        partial_json.loads("}")


def test_a_conversation_with_tools_renders_as_transformers_renders_vllms_messages():
    tokenizer = ModelTokenizer(TOKENIZER.to_str(), QWEN_TOOLS_TEMPLATE, None, (0,))
    body = ChatCompletionRequest.model_validate({"tools": TOOLS, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}]},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "Noon"}]})
    rendered = chat_render.render(tokenizer, body.messages, message_text, lambda r: ROLE_ALIASES.get(r, r), None,
                                  None, [tool.template_dict() for tool in body.tools])
    # What vLLM hands the template: text parts joined by newlines, arguments as objects (bad JSON: {}), the tools
    # as its dump (description and parameters even when null).
    vllm_messages = [
        {"role": "system", "content": "Be brief.\nReally."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "a"}, {"role": "tool", "content": "Noon",
                                                                     "tool_call_id": "b"}]
    vllm_tools = [{"type": "function", "function": {"name": t["function"]["name"],
                                                     "description": t["function"].get("description"),
                                                     "parameters": t["function"]["parameters"]}} for t in TOOLS]
    (expected,), _ = render_jinja_template(conversations=[vllm_messages], tools=vllm_tools,
                                           chat_template=QWEN_TOOLS_TEMPLATE, add_generation_prompt=True)
    assert TOKENIZER.decode(rendered, skip_special_tokens=False) == expected
    assert '"arguments": {"city": "Paris"}' in expected and '"description": null' in expected


@pytest.mark.parametrize(("parser", "answer"), [
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": "\\ud800!"}}</tool_call>'),
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": "\\ud800!"}}'),
    (PythonicParser, "[f(a='\\ud800!')]"),
    (MistralParser, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "\\ud800!"}}]')])
def test_a_lone_surrogate_a_model_writes_stays_an_escape_the_answer_can_carry(parser, answer: str):
    """JSON (and Python) can spell a lone UTF-16 surrogate; written raw into an answer, it failed the whole answer."""
    calls = parser(new_id).whole(answer).calls
    assert json.loads(calls[0].arguments) == {"a": "\ud800!"}
    assert "\\ud800" in ToolCall(id="x", function=calls[0]).model_dump_json()
    streamed = stream(parser(new_id), answer, 3)[1][0][1]
    assert json.loads(streamed) == {"a": "\ud800!"} and "\ud800" not in streamed, "streamed, the same"
