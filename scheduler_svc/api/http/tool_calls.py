"""``--tool-call-parser``: a model's own tool-call format read out of its answer, for ``tool_choice: "auto"``; the
behaviour of vLLM's parsers of the same names, whole and streamed.

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number of them; the text before the first is the content, and a call's arguments stream as generated.
* ``llama3_json`` (Llama 3.x): the answer is one or more ``{"name": ..., "parameters" | "arguments": ...}`` objects
  (``<|python_tag|>`` first, optionally, ``; `` between them); an answer that starts otherwise is content, and a
  call's arguments stream as their re-serialized JSON, closing quotes and brackets held until the call is complete.

``pythonic`` is in ``tool_pythonic``; ``tool_parsers`` names them all.

A parser reads one choice: ``whole`` a finished text; ``feed`` the text so far, delta by delta, answering what to
send now.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.api.http import partial_json
from scheduler_svc.api.http.tool_schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, arguments_json


@dataclass
class Extracted:
    """What ``whole`` found: the calls (empty when none was read) and the content left."""

    calls: list[FunctionCall]
    content: str | None


@dataclass
class Streamed:
    """What one delta sends: content, and call deltas."""

    content: str | None = None
    calls: list[DeltaToolCall] = field(default_factory=list)


def tag_overlap(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (held back: the tag may be arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def common_prefix(a: str, b: str, known: str = "") -> int:
    """How long a prefix ``a`` and ``b`` share; ``known``, a prefix of both as a rule (what was sent), is not compared
    again (a long argument would be, character by character, at every delta)."""
    start = len(known) if a.startswith(known) and b.startswith(known) else 0
    return next((start + i for i, (x, y) in enumerate(zip(a[start:], b[start:], strict=False)) if x != y),
                min(len(a), len(b)))


def complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
    ARGUMENTS = re.compile(r'"arguments"\s*:\s*')
    # The tags are special tokens in some models: the answer's text must keep them (vLLM's adjustment).
    keeps_special_tokens = True

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.text = ""
        self.content_sent = 0
        self.names: list[str | None] = []
        self.args_sent: list[str] = []

    def whole(self, text: str) -> Extracted:
        """Every call, or none (with the whole text as content) when any of them does not read."""
        if self.START not in text:
            return Extracted([], text)
        try:
            calls = []
            for closed, open_ in self.CALL.findall(text):
                call = json.loads(closed or open_)
                calls.append(FunctionCall(name=call["name"],
                                          arguments=arguments_json(call["arguments"])))
        except (ValueError, KeyError, TypeError):
            return Extracted([], text)
        return Extracted(calls, text[:text.find(self.START)] or None)

    def feed(self, delta: str) -> Streamed | None:
        self.text += delta
        content = self.new_content()
        deltas: list[DeltaToolCall] = []
        for i, (body, complete) in enumerate(self.regions()):
            if i == len(self.names):
                self.names.append(None)
                self.args_sent.append("")
            if self.names[i] is None:
                match = self.NAME.search(body)
                if match is None:
                    break  # a later call cannot go before this one
                self.names[i] = match.group(1)
                deltas.append(DeltaToolCall(index=i, id=self.new_id(), type="function",
                                            function=DeltaFunctionCall(name=match.group(1))))
            args = self.arguments(body, complete)
            if args is not None and len(args) > len(self.args_sent[i]):
                new, self.args_sent[i] = args[len(self.args_sent[i]):], args
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return Streamed(content, deltas) if content or deltas else None

    def unsent_arguments(self) -> str:
        """Arguments read but not sent: a call that named itself and never began its arguments reads as ``{}``."""
        return "{}" if self.names and not self.args_sent[-1] else ""

    def new_content(self) -> str | None:
        """The text before the first call not sent yet, less what could be a tag arriving."""
        start = self.text.find(self.START)
        end = start if start >= 0 else len(self.text) - tag_overlap(self.text, self.START)
        if end <= self.content_sent:
            return None
        content, self.content_sent = self.text[self.content_sent:end], end
        return content

    def regions(self) -> list[tuple[str, bool]]:
        """Each call's body so far, and whether it is complete (closed, or valid JSON already)."""
        out, pos = [], 0
        while (start := self.text.find(self.START, pos)) >= 0:
            body_start = start + len(self.START)
            end = self.text.find(self.END, body_start)
            if end >= 0:
                out.append((self.text[body_start:end].strip(), True))
                pos = end + len(self.END)
                continue
            body = self.text[body_start:]
            body = body[:len(body) - tag_overlap(body, self.END)].strip()
            out.append((body, bool(body) and complete_json(body)))
            break
        return out

    def arguments(self, body: str, complete: bool) -> str | None:
        """The text of the call's arguments so far; once their value reads whole, that value alone (the call's
        closing brace, or a ``"name"`` after them, left out)."""
        match = self.ARGUMENTS.search(body)
        if match is None:
            return None
        raw = body[match.end():]
        with contextlib.suppress(json.JSONDecodeError):
            return raw[:json.JSONDecoder().raw_decode(raw)[1]]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw


class Llama3JsonParser:
    BOT = "<|python_tag|>"
    keeps_special_tokens = False

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.text = ""
        self.current = -1
        self.name_sent = False
        self.args_sent: list[str] = []
        self.previous: list[dict] = []
        self.read: tuple[tuple[int, bool] | None, tuple[list[dict], list[bool]]] = (None, ([], []))
        # The arguments last read, and their JSON: the next reading compares with it.
        self.last_json: tuple[object, str] = (None, "")

    def whole(self, text: str) -> Extracted:
        """Every JSON object in the text is a call; none (and the text as content) if any is not one."""
        if self.BOT not in text and "{" not in text:
            return Extracted([], text)
        calls, end, decoder = [], -1, json.JSONDecoder()
        for match in re.finditer(r"\{", text):
            if match.start() <= end:
                continue
            try:
                call, length = decoder.raw_decode(text[match.start():])
                end = match.start() + length
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
                calls.append(FunctionCall(name=call["name"], arguments=arguments_json(arguments)))
            except (ValueError, KeyError, TypeError):
                return Extracted([], text)
        return Extracted(calls, None) if calls else Extracted([], text)

    def feed(self, delta: str) -> Streamed | None:
        """Nothing for a delta whose text does not read (yet), as vLLM's parser skips it. vLLM's parser takes one
        step a delta (start a call, name it, send its new arguments), which loses calls when a delta holds several
        tokens (the API process's pacing gathers them); here the steps go on while they make progress, so a delta
        sends what its tokens would have sent one by one."""
        self.text += delta
        if not self.text.startswith((self.BOT, "{")):
            return Streamed(content=delta)
        calls: list[DeltaToolCall] = []
        sent = False
        for first in itertools.chain([True], itertools.repeat(False, 4 * len(self.text))):
            try:
                out, progressed = self.step()
            except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                out, progressed = None, False
            if out is not None and (first or progressed):
                calls += out.calls
                sent = True
            if not progressed:
                break
        return Streamed(calls=calls) if sent else None

    def step(self) -> tuple[Streamed | None, bool]:
        """One of vLLM's steps over the text so far; whether it moved on (a call begun or named, arguments sent)."""
        calls, complete = self.read_calls()
        if not calls:
            return None, False
        call = calls[self.current]
        if self.current >= 0 and not self.name_sent and call.get("name"):  # named before the next begins
            self.previous, self.name_sent = calls, True
            return Streamed(calls=[DeltaToolCall(index=self.current, id=self.new_id(), type="function",
                                                 function=DeltaFunctionCall(name=call["name"]))]), True
        if len(calls) > self.current + 1:  # a new call began: first, what the last one still owes
            out = None
            if self.current >= 0 and call.get("arguments"):
                owed = arguments_json(call["arguments"])[len(self.args_sent[self.current]):]
                self.args_sent[self.current] += owed
                out = self.arguments_delta(owed)
            self.current, self.name_sent = self.current + 1, False
            self.args_sent.append("")
            return out, True
        out, progressed = None, False
        if self.name_sent and call.get("arguments"):
            out = self.new_arguments(call["arguments"], complete[self.current])
            progressed = bool(out and out.calls[0].function.arguments)
        self.previous = calls
        return out, progressed

    def read_calls(self) -> tuple[list[dict], list[bool]]:
        """Every object read so far (``parameters`` renamed ``arguments``), and whether each is complete; read once
        a delta (its steps ask again), unless naming a call changed how cut strings read."""
        key = (len(self.text), self.name_sent)
        if self.read[0] != key:
            self.read = (key, self.read_text())
        return self.read[1]

    def read_text(self) -> tuple[list[dict], list[bool]]:
        calls, complete = [], []
        start = len(self.BOT) if self.text.startswith(self.BOT) else 0
        while start < len(self.text):
            call, length = partial_json.loads(self.text[start:], strings=self.name_sent)
            complete.append(complete_json(self.text[start:start + length]))
            start += length + len("; ")
            if "parameters" in call:
                if "arguments" in call:
                    raise ValueError("the model generated both parameters and arguments")
                call["arguments"] = call["parameters"]
            calls.append(call)
        return calls, complete

    def new_arguments(self, arguments: object, complete: bool) -> Streamed | None:
        """All of the arguments' JSON once the call is complete; before, what two readings agree on."""
        sent = len(self.args_sent[self.current])
        now = arguments_json(arguments)
        before = self.previous[self.current].get("arguments")
        was = self.last_json[1] if self.last_json[0] is before else None
        self.last_json = (arguments, now)
        new = None
        if complete:
            new = now[sent:]
        elif before:
            was = arguments_json(before) if was is None else was
            if now != was:
                new = now[:common_prefix(was, now, self.args_sent[self.current])][sent:]
        if new is None:
            return None
        self.args_sent[self.current] += new
        return self.arguments_delta(new)

    def arguments_delta(self, new: str) -> Streamed:
        return Streamed(calls=[DeltaToolCall(index=self.current, function=DeltaFunctionCall(arguments=new))])

    def unsent_arguments(self) -> str:
        """The last call's arguments read but not sent yet."""
        if not self.previous:
            return ""
        last = len(self.previous) - 1
        arguments = self.previous[last].get("arguments", {})
        expected = arguments if isinstance(arguments, str) else arguments_json(arguments)
        sent = self.args_sent[last] if last < len(self.args_sent) else ""
        return expected[len(sent):] if expected.startswith(sent) else ""
