"""A chat answer read as vLLM reads it: its thinking (``reasoning``), then tool calls out of the content after it,
whole and streamed, choice by choice.

``ChatParsing`` is the scheduler's flags (``--enable-auto-tool-choice``, ``--tool-call-parser``,
``--reasoning-parser``); ``ChatOutput`` what applies to one request; ``ChoiceReader`` reads one choice. The order is
vLLM's: the reasoning parser splits the thinking off; then a forced choice's output is its schema's
(``forced_calls``), ``"auto"``'s is read by the tool parser (``tool_calls``), ``"none"``'s is content. Where the
server has a parser at all, vLLM reads every chat answer through it, so a streamed delta with no text then sends
nothing, as there.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.api.http import forced_calls
from scheduler_svc.api.http.reasoning import REASONING_PARSERS, ReasoningTokens, ThinkingStream
from scheduler_svc.api.http.tool_calls import Streamed
from scheduler_svc.api.http.tool_parsers import TOOL_PARSERS
from scheduler_svc.api.http.tool_request import ToolChoice
from scheduler_svc.api.http.tool_schemas import DeltaToolCall, FunctionCall, ToolCall
from scheduler_svc.core.tokenizer import ModelTokenizer

AUTO, TOOL_PARSER, REASONING_PARSER = "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"


def new_tool_call_id() -> str:
    """vLLM's: ``chatcmpl-tool-`` and 16 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(frozen=True)
class ChatParsing:
    """The scheduler's flags that read chat answers (and keep the Responses API's, ``responses_api.store``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # How many responses /v1/responses keeps (--responses-store); 0: none.
    responses_store: int = 1024
    # vLLM's --return-tokens-as-token-ids: logprobs name their tokens token_id:<id> unless a request says otherwise.
    return_tokens_as_token_ids: bool = False
    # vLLM's --default-chat-template-kwargs: the template variables a chat request starts from (its own win).
    default_chat_template_kwargs: dict[str, object] | None = None
    # vLLM's --enable-force-include-usage: a streamed answer ends with its usage, as if asked.
    force_include_usage: bool = False
    # vLLM's --trust-request-chat-template: a chat request's own chat_template renders its conversation.
    trust_chat_template: bool = False

    @property
    def auto_tool_parser(self) -> str:
        """The parser ``"auto"`` reads calls with, "" when ``"auto"`` is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else ""


# No flags: "auto" refused, no thinking read (the routes' default where no flags are given, as in tests).
NO_PARSING = ChatParsing()


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read."""

    choice: ToolChoice = field(default_factory=ToolChoice)
    # The tool parser's name where "auto" may call tools (the flags), else "".
    tool_parser: str = ""
    reasoning_parser: str = ""
    # The request's chat_template_kwargs enable_thinking (Qwen3's switch).
    thinking: bool = True
    # The answer starts at once, with no thinking to read: a grammar holds it from its first token (structured
    # output, a forced tool choice, with no thinking to wait for: ``api.thinking``), or the prompt closed the
    # thinking (vLLM then reads it all as content).
    answers_at_once: bool = False
    # vLLM's include_reasoning: false leaves the thinking out, and with it the tokens' logprobs and ids.
    include_reasoning: bool = True

    @property
    def active(self) -> bool:
        """Whether choices are read at all (else their text is the content, as without any parser)."""
        return bool(self.tool_parser or self.reasoning_parser) or self.choice.forced

    @property
    def hides_tokens(self) -> bool:
        """vLLM hides logprobs and token ids where a parser runs and the thinking is left out (they would show it)."""
        return not self.include_reasoning and bool(self.tool_parser or self.reasoning_parser)

    def reader(self) -> ChoiceReader:
        return ChoiceReader(self)

    def reasoning_tokens(self, tokenizer: ModelTokenizer | None) -> ReasoningTokens | None:
        """A counter of one choice's thinking tokens, where the server has a reasoning parser (else no count)."""
        if not self.reasoning_parser:
            return None
        return ReasoningTokens(self.reasoning_parser, self.thinking and not self.answers_at_once, tokenizer)

    def finish_reason(self, finish: str | None, called: bool, streamed: bool) -> str | None:
        """vLLM's: "tool_calls" when "auto" called a tool (streamed: and the choice stopped) or "required" stopped
        (streamed: having called one); a named call keeps its finish."""
        kind = self.choice.kind
        if streamed:
            return "tool_calls" if called and kind != "named" and finish == "stop" else finish
        if (kind == "auto" and called) or (kind == "required" and finish == "stop"):
            return "tool_calls"
        return finish

    def one_call(self, calls: list) -> list:
        """parallel_tool_calls false: the first call alone (streamed: the deltas of call 0)."""
        if self.choice.parallel is not False:
            return calls
        return [call for call in calls if call.index == 0] if calls and isinstance(calls[0], DeltaToolCall) \
            else calls[:1]


@dataclass
class Parsed:
    """A whole choice read: its thinking, its content, its calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


@dataclass
class DeltaParts:
    """What one streamed delta sends."""

    content: str | None = None
    calls: list[DeltaToolCall] = field(default_factory=list)
    reasoning: str | None = None


class ChoiceReader:
    """One choice, read whole (``whole``) or delta by delta (``delta``)."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        choice = output.choice
        parser = TOOL_PARSERS[output.tool_parser] if output.tool_parser else None
        # The ids of every call, forced or not: the model's own where its parser has them (Mistral's template checks).
        self.new_id: Callable[[], str] = getattr(parser, "call_id", new_tool_call_id)
        self.forced: forced_calls.RequiredStream | forced_calls.NamedStream | None = (
            forced_calls.NamedStream(choice.name, self.new_id) if choice.kind == "named"
            else forced_calls.RequiredStream(self.new_id) if choice.kind == "required" else None)
        self.parser = parser(self.new_id) if parser is not None and choice.kind == "auto" else None
        reasoning = REASONING_PARSERS[output.reasoning_parser] if output.reasoning_parser else None
        self.reasoning = reasoning(output.thinking) if reasoning is not None and not output.answers_at_once else None
        # The thinking still being streamed; None once it ended (or when there is none).
        self.thinking: ThinkingStream | None = self.reasoning.stream() if self.reasoning is not None else None
        # Whether any delta sent a call (vLLM's tools_streamed).
        self.called = False

    def whole(self, text: str) -> Parsed:
        reasoning, content = self.reasoning.whole(text) if self.reasoning is not None else (None, text)
        if not self.output.include_reasoning:
            reasoning = None
        choice = self.output.choice
        if choice.kind == "named":
            return Parsed(reasoning, "", with_ids(forced_calls.named_call(choice.name, content), self.new_id))
        if choice.kind == "required":
            return Parsed(reasoning, "", with_ids(forced_calls.required_calls(content), self.new_id))
        if self.parser is not None:
            extracted = self.parser.whole(content or "")
            if extracted.calls:
                content = extracted.content if extracted.content and extracted.content.strip() else None
                return Parsed(reasoning, content, with_ids(extracted.calls, self.new_id))
        return Parsed(reasoning, content, [])

    def delta(self, text: str, finished: bool) -> DeltaParts | None:
        """None: nothing to send for this delta. The delta that ends the thinking sends the content after it too
        (read for calls when they are read)."""
        reasoning = None
        if self.thinking is not None:
            step = self.thinking.feed(text)
            reasoning = step.reasoning + ("" if step.ended or not finished else self.thinking.finish())
            if step.ended:
                self.thinking = None
                parts = self.tool_delta(step.content, ended_thinking=True)
            else:
                parts = None
        else:
            parts = self.tool_delta(text)
        if finished and self.parser is not None and parts is not None and parts.calls:
            last = parts.calls[-1]
            if last.function is not None:
                last.function.arguments = (last.function.arguments or "") + self.parser.unsent_arguments()
        if parts is not None and parts.calls:
            self.called = True
        if reasoning and self.output.include_reasoning:
            parts = parts or DeltaParts()
            parts.reasoning = reasoning
        return parts

    def tool_delta(self, text: str, ended_thinking: bool = False) -> DeltaParts | None:
        if self.forced is not None:
            return DeltaParts(calls=calls) if (calls := self.forced.feed(text)) else None
        if self.parser is not None:
            streamed: Streamed | None = self.parser.feed(text)
            return DeltaParts(streamed.content, streamed.calls) if streamed is not None else None
        if self.output.tool_parser or ended_thinking:  # read for calls none of which are asked: its text, if any
            return DeltaParts(text) if text else None
        return DeltaParts(text)


def with_ids(calls: list[FunctionCall], new_id: Callable[[], str] = new_tool_call_id) -> list[ToolCall]:
    return [ToolCall(id=new_id(), function=call) for call in calls]
