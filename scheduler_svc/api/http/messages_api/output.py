"""A chat answer as Anthropic's message: its thinking a ``thinking`` block, its text a ``text`` block, each tool call
a ``tool_use`` block (read by the chat route's readers, ``chat_output``); whole, or as the streamed events that
start each block, carry its deltas and stop it, between ``message_start`` and ``message_delta`` (the stop reason
and usage) and ``message_stop``, as vLLM sends them. A thinking block's signature is a random token, as vLLM's.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import responses
from scheduler_svc.api.http.chat_output import DeltaParts
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.messages_api.inputs import renamed
from scheduler_svc.api.http.messages_api.schemas import MessageObject, Usage
from scheduler_svc.api.http.schemas import CompletionUsage
from scheduler_svc.api.http.tool_schemas import DeltaToolCall
from scheduler_svc.api.http.translate import Translated, api_error
from scheduler_svc.core.errors import RequestFailed


def stop_reason(finish: str | None, matched: str | int | None, called: bool,
                arguments_complete: bool) -> tuple[str | None, str | None]:
    """vLLM's (stop_reason, stop_sequence): ``max_tokens`` first; a matched stop string unless it came after
    complete tool calls; ``tool_use`` where the model called a tool; else ``end_turn``."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if called and arguments_complete:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


def usage_of(usage: CompletionUsage) -> Usage:
    """Anthropic counts the prompt's cached tokens apart from ``input_tokens``."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Usage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                 cache_read_input_tokens=cached)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is (the parsers write a JSON object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def whole_message(message_id: str, t: Translated, generations: list[Generation]) -> MessageObject:
    try:
        choices, usage = await responses.whole(t, generations)
    except ApiError as e:
        raise renamed(e) from e
    choice, output = choices[0], t.chat_output
    reasoning, content, calls = None, choice.text, []
    if output is not None and output.active:
        parsed = output.reader().whole(choice.text)
        reasoning, content, calls = parsed.reasoning, parsed.content, output.one_call(parsed.calls)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.function.name,
                "input": tool_input(call.function.arguments)} for call in calls]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(calls),
                                   all(is_json(call.function.arguments) for call in calls))
    return MessageObject(id=message_id, content=blocks or [{"type": "text", "text": ""}], model=t.model,
                         stop_reason=reason, stop_sequence=sequence, usage=usage_of(usage))


def json_body(data: object) -> str:
    """JSON text as Anthropic writes it (non-ASCII as it is), unless a lone surrogate a model wrote in a call's
    arguments (``tool_input`` reads it back) cannot be UTF-8: then every such character is an escape."""
    text = json.dumps(data, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(data)
    return text


def sse(kind: str, **fields: object) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class BlockWriter:
    """The content blocks of one streamed answer, numbered from 0 in the order they start."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self.call_index: int | None = None
        self.called = False
        self.arguments = ""  # the last call's, so far
        self.blank = ""  # blank text held back: before a call it is no block

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.open = kind
        return [*events, sse("content_block_start", index=self.index, content_block=block)]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(sse("content_block_delta", index=self.index,
                              delta={"type": "signature_delta", "signature": uuid.uuid4().hex}))
        self.open = None
        return [*events, sse("content_block_stop", index=self.index)]

    def delta(self, kind: str, **delta: object) -> str:
        return sse("content_block_delta", index=self.index, delta={"type": kind, **delta})

    def text(self, text: str, hold: bool = True) -> list[str]:
        if hold and self.open != "text" and not (self.blank + text).strip():
            self.blank += text
            return []
        text, self.blank = self.blank + text, ""
        events = [] if self.open == "text" else self.start("text", {"type": "text", "text": ""})
        return [*events, self.delta("text_delta", text=text)]

    def feed(self, parts: DeltaParts) -> list[str]:
        events = []
        if parts.reasoning:
            if self.open != "thinking":
                events += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta("thinking_delta", thinking=parts.reasoning))
        if parts.content:
            events += self.text(parts.content)
        for index, group in itertools.groupby(parts.calls, key=lambda call: call.index):
            calls: list[DeltaToolCall] = list(group)
            if self.open != "tool_use" or self.call_index != index:
                first = calls[0]
                name = first.function.name if first.function is not None and first.function.name else ""
                self.blank, self.called, self.call_index, self.arguments = "", True, index, ""
                events += self.start("tool_use", {"type": "tool_use", "id": first.id or "", "name": name,
                                                  "input": {}})
            arguments = "".join(call.function.arguments or "" for call in calls if call.function is not None)
            if arguments:
                self.arguments += arguments
                events.append(self.delta("input_json_delta", partial_json=arguments))
        return events

    def finish(self) -> list[str]:
        """The last block stopped; blank text held back is the answer's text where no call followed it."""
        events = self.text("", hold=False) if self.blank and not self.called else []
        return events + self.stop()


async def events(message_id: str, t: Translated, generations: list[Generation]) -> AsyncIterator[str]:
    """The answer's events; a request that fails after the stream began ends it with an ``error`` event."""
    prompt = sum(generation.num_prompt_tokens for generation in generations)
    yield sse("message_start", message=MessageObject(
        id=message_id, content=[], model=t.model, usage=Usage(input_tokens=prompt, output_tokens=0)).model_dump())
    output = t.chat_output if t.chat_output is not None and t.chat_output.active else None
    reader = output.reader() if output is not None else None
    writer, usage, finish, matched = BlockWriter(), responses.UsageTotal(), None, None
    try:
        async for piece in responses.pieces(t, generations):
            usage.add(piece.usage)
            if piece.finish_reason is not None:
                finish, matched = piece.finish_reason, piece.stop_reason
            parts = DeltaParts(piece.text) if reader is None else reader.delta(
                piece.text, finished=piece.finish_reason is not None)
            if parts is not None:
                if output is not None:
                    parts.calls = output.one_call(parts.calls)
                for event in writer.feed(parts):
                    yield event
    except RequestFailed as e:
        error = renamed(api_error(e, t.renames))
        yield sse("error", error=error.anthropic()["error"])
        return
    for event in writer.finish():
        yield event
    reason, sequence = stop_reason(finish, matched, writer.called, is_json(writer.arguments))
    yield sse("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
              usage=usage_of(usage.usage()).model_dump())
    yield sse("message_stop")
