"""The output of a ``"required"`` or named tool choice read as tool calls, whole and streamed, as vLLM reads it.

A named function's output is its arguments, as generated. ``"required"``'s is a JSON array of
``{"name", "parameters"}`` objects (``tool_request.forced_schema``); each becomes a call whose arguments are the
parameters re-serialized. Streamed, a call is announced (id, name) once its name is closed and its parameters have
begun, and then sends its parameters' text as it comes, exactly as generated; several calls may move in one delta.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from scheduler_svc.api.http.tool_schemas import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    arguments_json,
)

# An element of "required"'s array, read as vLLM reads it.
DEFINITIONS = TypeAdapter(list[FunctionDefinition])


def named_call(name: str, content: str | None) -> list[FunctionCall]:
    """No call for an empty (or blank) output."""
    if content is None or not content.strip():
        return []
    return [FunctionCall(name=name, arguments=content)]


def required_calls(content: str | None) -> list[FunctionCall]:
    """The calls of the array; none when the text is not such an array (vLLM validates it whole, as function
    definitions)."""
    try:
        items = DEFINITIONS.validate_json(content or "")
    except ValidationError:
        return []
    return [FunctionCall(name=item.name, arguments=arguments_json(item.parameters)) for item in items]


@dataclass
class CallSpan:
    """Where one element of the array stands in the text: its name once its string closed, and where its
    parameters' value starts and ends (end None while it is still being generated)."""

    name: str | None = None
    name_end: int = 0
    args_start: int | None = None
    args_end: int | None = None

    def ready_by(self, length: int) -> bool:
        """Whether the first ``length`` characters already announced this call."""
        return (self.name is not None and self.name_end <= length and self.args_start is not None
                and self.args_start < length)


class ArrayScanner:
    """One pass over a (partial) array of calls, aware of strings and nesting; what it finds in a prefix of a text is
    what it finds in the whole text cut to that prefix, so the spans tell what an earlier prefix had shown."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.spans: list[CallSpan] = []
        self.depth = 0  # element objects sit at depth 2
        self.key: str | None = None
        self.expect = "key"  # key, colon, value, string, container, scalar, after
        self.value_start = 0

    def scan(self) -> list[CallSpan]:
        text, i, n = self.text, 0, len(self.text)
        while i < n:
            ch = text[i]
            if ch == '"':
                end = closing_quote(text, i)
                if end is None:  # still open: a value that begins here has begun all the same
                    if self.depth == 2 and self.spans and self.expect == "value":
                        self.start_value(i)
                    break
                self.string(i, end)
                i = end + 1
                continue
            if ch in "{[":
                if not self.open(ch, i):
                    break
            elif ch in "}]":
                if not self.close(i):
                    break
            elif self.depth == 2 and self.spans:
                self.punctuation(ch, i)
            i += 1
        return self.spans

    def string(self, start: int, end: int) -> None:
        if self.depth != 2 or not self.spans:
            return
        if self.expect == "key":
            self.key, self.expect = self.text[start + 1:end], "colon"
        elif self.expect == "value":
            self.start_value(start)
            self.end_value(end + 1, string=True)

    def open(self, ch: str, i: int) -> bool:
        if self.depth == 0 and ch != "[" or self.depth == 1 and ch != "{":
            return False
        if self.depth == 1:
            self.spans.append(CallSpan())
            self.expect, self.key = "key", None
        elif self.depth == 2 and self.spans and self.expect == "value":
            self.start_value(i)
            self.expect = "container"
        self.depth += 1
        return True

    def close(self, i: int) -> bool:
        if self.depth == 2 and self.spans and self.expect == "scalar":
            self.end_value(i)
        self.depth -= 1
        if self.depth == 2 and self.spans and self.expect == "container":
            self.end_value(i + 1)
        return self.depth > 0

    def punctuation(self, ch: str, i: int) -> None:
        if ch == ":":
            if self.expect == "colon":
                self.expect = "value"
        elif ch == ",":
            if self.expect == "scalar":
                self.end_value(i)
            self.expect, self.key = "key", None
        elif ch.isspace():
            if self.expect == "scalar":
                self.end_value(i)
        elif self.expect == "value":
            self.start_value(i)
            self.expect = "scalar"

    def start_value(self, i: int) -> None:
        self.value_start = i
        if self.key == "parameters":
            self.spans[-1].args_start = i

    def end_value(self, i: int, string: bool = False) -> None:
        span = self.spans[-1]
        if self.key == "parameters":
            span.args_end = i
        elif self.key == "name" and string:
            try:
                span.name, span.name_end = json.loads(self.text[self.value_start:i]), i
            except json.JSONDecodeError:
                span.name = None
        self.expect = "after"


def closing_quote(text: str, start: int) -> int | None:
    """The index of the quote that closes the string opened at ``start``; None if it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return None


class RequiredStream:
    """``"required"``'s calls streamed: each call is sent once announceable, then its new parameter text."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.text = ""
        self.new_id = new_id

    def feed(self, delta: str) -> list[DeltaToolCall]:
        sent, self.text = len(self.text), self.text + delta
        out = []
        for index, span in enumerate(ArrayScanner(self.text).scan()):
            if span.name is None or span.args_start is None:
                break  # calls come in order: none after this one is ready
            end = span.args_end if span.args_end is not None else len(self.text)
            if span.ready_by(sent):
                if new := self.text[min(end, sent):end]:
                    out.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new)))
                continue
            out.append(DeltaToolCall(index=index, id=self.new_id(), type="function",
                                     function=DeltaFunctionCall(name=span.name,
                                                                arguments=self.text[span.args_start:end])))
        return out


class NamedStream:
    """A named function's arguments streamed as generated; its first delta names the call."""

    def __init__(self, name: str, new_id: Callable[[], str]) -> None:
        self.name, self.new_id = name, new_id
        self.announced = False

    def feed(self, delta: str) -> list[DeltaToolCall]:
        if self.announced:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        self.announced = True
        return [DeltaToolCall(index=0, id=self.new_id(), type="function",
                              function=DeltaFunctionCall(name=self.name, arguments=delta))]
