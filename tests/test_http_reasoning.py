"""--reasoning-parser through the OpenAI API (the real ``openai`` SDK, the echo executor answering each chat with
its last message, as in ``test_http_tools``): the thinking goes to the message's ``reasoning`` and out of its
``content``, whole and streamed alike, with vLLM's count of reasoning tokens; tool calls are read from the content
after it; a grammar waits for the thinking's end unless ``enable_thinking`` is off or ``include_reasoning`` false,
as the docs say. The parsers themselves on text: ``test_http_reasoning_parsers``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from common.step import SamplingSettings, StepPlan, StepResult
from executor_svc.fakes.shadow_server import EchoExecutor
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.config import parse_config
from tests.http_fixtures import Hosted, hosted
from tests.test_http_tools import (
    AUTO,
    ECHO_LAST,
    QWEN_TOOLS_TEMPLATE,
    TOKENIZER,
    TOOLS,
    answering,
    echo_last,
    serving,
    streamed_calls,
)

QWEN3 = {"NANOSERVE_REASONING_PARSER": "qwen3"}
THOUGHT = "<think>\nThe user wants a city. Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def qwen3_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({**QWEN3, **AUTO, "NANOSERVE_TOOL_CALL_PARSER": "hermes"}, request.param) as h:
        yield h


@pytest.fixture
def api(qwen3_api: Hosted) -> Iterator[Hosted]:
    yield qwen3_api
    qwen3_api.assert_idle()


def streamed(client: openai.OpenAI, request: dict) -> tuple[str, str, list]:
    """A stream's reasoning and content joined, and its chunks."""
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reasoning, content, chunks


def thinking_tokens(text: str) -> int:
    """The tokens before </think>, less <think>'s: what qwen3 counts."""
    head = TOKENIZER.encode(text.partition("</think>")[0]).ids
    return len([t for t in head if t != TOKENIZER.token_to_id("<think>")])


def test_qwen3_thinking_goes_to_reasoning_whole_and_streamed(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(**answering(THOUGHT))
    message = reply.choices[0].message
    assert (message.reasoning, message.content) == ("\nThe user wants a city. Paris.\n", "\n\nParis.")
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking_tokens(THOUGHT)
    reasoning, content, chunks = streamed(client, answering(THOUGHT))
    assert (reasoning, content) == (message.reasoning, message.content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking_tokens(THOUGHT)
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_unfinished_thinking_is_all_reasoning(api: Hosted):
    client = api.openai()
    cut = len(TOKENIZER.encode("<think>\nThe user wants").ids)
    reply = client.chat.completions.create(**answering(THOUGHT, max_tokens=cut))
    assert (reply.choices[0].message.reasoning, reply.choices[0].message.content) == ("\nThe user wants", None)
    assert streamed(client, answering(THOUGHT, max_tokens=cut))[:2] == ("\nThe user wants", "")


def test_enable_thinking_off_reads_no_thinking(api: Hosted):
    client = api.openai()
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    reply = client.chat.completions.create(**answering("Paris.", **off))
    assert (reply.choices[0].message.reasoning, reply.choices[0].message.content) == (None, "Paris.")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    assert streamed(client, answering("Paris.", **off))[:2] == ("", "Paris.")


def test_reasoning_effort_none_turns_thinking_off_as_on_vllm(api: Hosted):
    client = api.openai()
    off = client.chat.completions.create(**answering("Paris.", reasoning_effort="none"))
    assert (off.choices[0].message.reasoning, off.choices[0].message.content) == (None, "Paris.")
    kept = {"reasoning_effort": "none", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    on = client.chat.completions.create(**answering(THOUGHT, **kept))  # the request's own switch wins
    assert on.choices[0].message.reasoning == "\nThe user wants a city. Paris.\n"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**answering("Paris.", reasoning_effort="extreme"))
    assert refused.value.param == "reasoning_effort"


def test_tool_calls_are_read_after_the_thinking(api: Hosted):
    answer = ('<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>')
    client = api.openai()
    reply = client.chat.completions.create(**answering(answer, tools=TOOLS))
    choice = reply.choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (
        "I need the weather.", None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, _, chunks = streamed(client, answering(answer, tools=TOOLS))
    content, calls, finishes = streamed_calls(chunks)
    assert (reasoning, content, calls[0]["name"], calls[0]["arguments"]) == (
        "I need the weather.", "\n\n", "get_weather", '{"city": "Paris"}')
    assert [f for f in finishes if f] == ["tool_calls"]
    # A call that ends the thinking without </think> (Qwen3 does that), as vLLM reads it.
    implicit = client.chat.completions.create(**answering(answer.replace("</think>\n\n", ""), tools=TOOLS))
    assert implicit.choices[0].message.reasoning == "I need the weather."
    assert implicit.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_include_reasoning_false_leaves_the_thinking_and_its_tokens_out(api: Hosted):
    client = api.openai()
    hidden = {"logprobs": True, "extra_body": {"include_reasoning": False, "return_token_ids": True}}
    reply = client.chat.completions.create(**answering(THOUGHT, **hidden))
    choice = reply.choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.logprobs) == (None, "\n\nParis.", None)
    assert getattr(choice, "token_ids", None) is None
    reasoning, content, chunks = streamed(client, answering(THOUGHT, **hidden))
    assert (reasoning, content) == ("", "\n\nParis.")
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


class RecordingEcho(EchoExecutor):
    """The echo executor, keeping the sampling settings each request reached it with (it does not mask)."""

    def __init__(self) -> None:
        super().__init__(echo_last().info)
        self.sampling: list[SamplingSettings] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.sampling.extend(new.sampling for new in plan.new_requests)
        return super().step(plan)


JSON_OBJECT = {"response_format": {"type": "json_object"}}
WAITS = (TOKENIZER.token_to_id("</think>"),)


def waits(settings: SamplingSettings) -> tuple[int, ...]:
    return settings.grammar_after_token_ids


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_a_grammar_waits_for_the_end_of_the_thinking_as_on_vllm(api_process: bool):
    """The grammar holds the answer after </think>: the thinking before it is read as such."""
    executor = RecordingEcho()
    with hosted(executor, api_process=api_process, reasoning_parser="qwen3") as h:
        client = h.openai()
        answer = '<think>The user wants JSON.</think>\n\n{"city": "Paris"}'
        reply = client.chat.completions.create(**answering(answer, **JSON_OBJECT))
        assert (reply.choices[0].message.reasoning, reply.choices[0].message.content) == (
            "The user wants JSON.", '\n\n{"city": "Paris"}')
        assert streamed(client, answering(answer, **JSON_OBJECT))[:2] == (
            "The user wants JSON.", '\n\n{"city": "Paris"}')
        # A prompt that closed no thinking (the echo's prompt is its answer): the executor is told to wait.
        unclosed = client.chat.completions.create(**answering('{"city": "Paris"}', **JSON_OBJECT))
        assert waits(executor.sampling[-1]) == WAITS
        assert (unclosed.choices[0].message.reasoning, unclosed.choices[0].message.content) == (
            '{"city": "Paris"}', None), "an answer that never closed its thinking is all thinking, as vLLM reads it"
        named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        call = client.chat.completions.create(**answering(
            '<think>I need the weather.</think>\n\n{"city": "Paris"}', **named)).choices[0].message
        assert call.reasoning == "I need the weather."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in call.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        h.assert_idle()


def test_a_grammar_applies_at_once_where_no_thinking_is_read():
    """include_reasoning false and enable_thinking off start the grammar at the first token (vLLM's
    reasoning_ended), and the answer is all content; so does a server without a reasoning parser."""
    executor = RecordingEcho()
    with hosted(executor, reasoning_parser="qwen3") as h:
        client = h.openai()
        for extra in ({"include_reasoning": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
            reply = client.chat.completions.create(**answering('{"city": "Paris"}', **JSON_OBJECT, extra_body=extra))
            assert (reply.choices[0].message.reasoning, reply.choices[0].message.content) == (
                None, '{"city": "Paris"}'), extra
            assert waits(executor.sampling[-1]) == (), extra
        h.assert_idle()
    executor = RecordingEcho()
    with hosted(executor) as h:
        reply = h.openai().chat.completions.create(**answering('{"city": "Paris"}', **JSON_OBJECT))
        assert reply.choices[0].message.content == '{"city": "Paris"}'
        assert waits(executor.sampling[-1]) == ()
        h.assert_idle()


def test_deepseek_r1_thinks_until_its_end_marker():
    # R1's template opens the thinking at the prompt's end (its answer then holds no <think> of its own).
    r1_template = ECHO_LAST + QWEN_TOOLS_TEMPLATE + "<think>\n"
    with serving({"NANOSERVE_REASONING_PARSER": "deepseek_r1"}, template=r1_template) as h:
        client = h.openai()
        answer = "The user greets.\n</think>\n\nHello!"
        reply = client.chat.completions.create(**answering(answer))
        message = reply.choices[0].message
        assert (message.reasoning, message.content) == ("The user greets.\n", "\n\nHello!")
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0  # no <think> of its own: vLLM counts 0
        assert streamed(client, answering(answer))[:2] == (message.reasoning, message.content)
        plain = client.chat.completions.create(**answering("Hello!"))
        assert (plain.choices[0].message.reasoning, plain.choices[0].message.content) == ("Hello!", None)
        h.assert_idle()


def test_earlier_thinking_and_the_reasoning_effort_reach_the_template():
    template = (ECHO_LAST + "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.content }}]"
                "{% endfor %}{{ reasoning_effort }}{{ enable_thinking }}")
    with serving(QWEN3, template=template) as h:
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
                    {"role": "assistant", "content": "Again.", "reasoning": "Once more."},
                    {"role": "user", "content": "Bye"}]
        rendered = h.openai().post("/chat/completions/render", cast_to=object, body={"messages": messages})
        prompt = TOKENIZER.decode(rendered["token_ids"], skip_special_tokens=False)
        assert prompt.endswith("[user||Hi][assistant|Greet back.|Hello.][assistant|Once more.|Again.][user||Bye]")
        effort = h.openai().post("/chat/completions/render", cast_to=object,
                                 body={"messages": messages[-1:], "reasoning_effort": "low"})
        assert TOKENIZER.decode(effort["token_ids"], skip_special_tokens=False).endswith("[user||Bye]lowTrue")


def test_the_flag_is_vllms_with_its_environment_form(capsys: pytest.CaptureFixture[str]):
    assert parse_config(["--reasoning-parser", "qwen3"], {}).chat_parsing() == ChatParsing(reasoning_parser="qwen3")
    assert parse_config([], {"NANOSERVE_REASONING_PARSER": "deepseek_r1"}).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parse_config(["--reasoning-parser", "granite"], {})
    assert "invalid choice: 'granite'" in capsys.readouterr().err


def test_a_prompt_that_closed_the_thinking_is_answered_in_content_as_on_vllm():
    """A final assistant message continued after its closed thought: the grammar applies at once and the answer is
    content, not thinking, as vLLM reads it (its reasoning parser finds the prompt's end of thinking)."""
    executor = RecordingEcho()
    with hosted(executor, reasoning_parser="qwen3") as h:
        client = h.openai()
        messages = [{"role": "user", "content": "JSON?"}, {"role": "assistant", "content": "<think>ok</think>"}]
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        for options in (JSON_OBJECT, {}):
            reply = client.chat.completions.create(model="tools", messages=messages, max_tokens=4, extra_body=extra,
                                                   **options)
            message = reply.choices[0].message
            assert message.reasoning is None and message.content.startswith("<think>ok</think>"), options
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        assert waits(executor.sampling[-2]) == () and executor.sampling[-2].grammar is not None
        h.assert_idle()
