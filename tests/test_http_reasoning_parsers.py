"""The reasoning parsers on text: ``qwen3`` and ``deepseek_r1`` whole and streamed (a character at a time and in
one delta give the same thinking and content), their markers held back while they may be arriving, the thinking's
token count, and a choice read with both a reasoning and a tool parser, as vLLM composes them."""

from __future__ import annotations

import pytest

from scheduler_svc.api.http.chat_output import ChatOutput
from scheduler_svc.api.http.reasoning import DeepSeekR1Reasoning, Qwen3Reasoning, Qwen3Stream, ReasoningTokens
from scheduler_svc.api.http.tool_request import ToolChoice
from scheduler_svc.api.http.tool_schemas import Tool
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.test_http_tools import TOKENIZER, TOOLS

QWEN3_CASES = [
    ("<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    ("hmm</think>Paris.</think>", ("hmm", "Paris.")),  # the template opened it; a later </think> is dropped
    ("still thinking", ("still thinking", None)),
    ('hmm<tool_call>{"name": "f"}</tool_call>', ("hmm", '<tool_call>{"name": "f"}</tool_call>')),
    ("</think>Paris.", (None, "Paris.")),
]


@pytest.mark.parametrize(("text", "expected"), QWEN3_CASES)
def test_qwen3_whole(text: str, expected: tuple):
    assert Qwen3Reasoning().whole(text) == expected
    assert Qwen3Reasoning(thinking=False).whole(text) == (None, text)


DEEPSEEK_CASES = [
    ("hmm</think>Paris.", ("hmm", "Paris.")),
    ("ignored<think>hmm</think>", ("hmm", None)),
    ("all thought", ("all thought", None)),
    ("</think>Paris.</think>", ("", "Paris.</think>")),
]


@pytest.mark.parametrize(("text", "expected"), DEEPSEEK_CASES)
def test_deepseek_r1_whole(text: str, expected: tuple):
    assert DeepSeekR1Reasoning().whole(text) == expected


@pytest.mark.parametrize("size", [1, 2, 1000])
@pytest.mark.parametrize("parser", [Qwen3Reasoning(), DeepSeekR1Reasoning()], ids=["qwen3", "deepseek_r1"])
def test_streamed_thinking_is_the_whole_ones(parser, size: int):
    text = "<think>\nthe <b> tag</thi\nnk></think>\n\nParis."
    stream, reasoning, content, ended = parser.stream(), "", "", False
    for start in range(0, len(text), size):
        if ended:
            content += text[start:start + size]
            continue
        step = stream.feed(text[start:start + size])
        reasoning, content, ended = reasoning + step.reasoning, content + step.content, step.ended
    assert (reasoning, content) == ("\nthe <b> tag</thi\nnk>", "\n\nParis.")
    whole_reasoning, whole_content = parser.whole(text)
    assert (whole_reasoning.removeprefix("<think>"), whole_content) == (reasoning.removeprefix("<think>"), content)


def test_a_marker_that_may_be_arriving_waits():
    stream = Qwen3Stream()
    assert stream.feed("hmm </th").reasoning == "hmm "
    step = stream.feed("ink>ok")
    assert (step.reasoning, step.content, step.ended) == ("", "ok", True)
    cut = Qwen3Stream()
    assert cut.feed("a <tool_c").reasoning == "a " and cut.finish() == "<tool_c"


def test_the_thinking_tokens_are_counted_as_vllm_counts_them():
    tokenizer = ModelTokenizer(TOKENIZER.to_str())
    ids = TOKENIZER.encode("<think>ab</think>cd").ids
    thought = len(TOKENIZER.encode("ab").ids)
    assert ReasoningTokens("qwen3", True, tokenizer).add(ids) == thought
    assert ReasoningTokens("qwen3", False, tokenizer).add(ids) == 0
    assert ReasoningTokens("deepseek_r1", True, tokenizer).add(ids) == thought
    assert ReasoningTokens("deepseek_r1", True, tokenizer).add(TOKENIZER.encode("ab</think>cd").ids) == 0
    counter = ReasoningTokens("qwen3", True, tokenizer)
    for token in TOKENIZER.encode("xy<tool_call>z").ids:  # a call ends it too
        counter.add([token])
    assert counter.count == len(TOKENIZER.encode("xy").ids)


ANSWER = ('<think>weather needed</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
          '\n</tool_call>')


@pytest.mark.parametrize("size", [1, 7, len(ANSWER)])
def test_a_choice_reads_thinking_then_calls_whatever_the_deltas(size: int):
    output = ChatOutput(ToolChoice("auto", tools=tuple(Tool.model_validate(t) for t in TOOLS)), "hermes", "qwen3")
    whole = output.reader().whole(ANSWER)
    assert (whole.reasoning, whole.content) == ("weather needed", "\n\nSure.\n")
    assert [(c.function.name, c.function.arguments) for c in whole.calls] == [("get_weather", '{"city": "Oslo"}')]
    reader, reasoning, content, arguments = output.reader(), "", "", ""
    for start in range(0, len(ANSWER), size):
        parts = reader.delta(ANSWER[start:start + size], finished=start + size >= len(ANSWER))
        if parts is not None:
            reasoning += parts.reasoning or ""
            content += parts.content or ""
            arguments += "".join(c.function.arguments or "" for c in parts.calls if c.function)
    assert (reasoning, content, arguments, reader.called) == ("weather needed", "\n\nSure.\n", '{"city": "Oslo"}',
                                                              True)


def test_a_constrained_answer_is_not_read_for_thinking():
    output = ChatOutput(reasoning_parser="qwen3", answers_at_once=True)
    assert output.reader().whole('{"a": 1}').content == '{"a": 1}'
    assert output.reasoning_tokens(None).add([1, 2]) == 0
