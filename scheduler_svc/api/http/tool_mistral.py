"""``--tool-call-parser mistral`` (Mistral 7B Instruct v0.3, Mistral Nemo, Ministral: ``MistralForCausalLM``), as
vLLM's parser of that name reads an answer with a Hugging Face tokenizer: the text before ``[TOOL_CALLS]`` is the
content, and after it the calls, in either of Mistral's two forms:

* before its v11 tokenizers (no ``[ARGS]`` token): a JSON array of ``{"name": ..., "arguments": {...}}`` objects (or
  one such object); entries that are no call are skipped, a name that is no string reads as "", arguments given as a
  string are kept as they are;
* from v11 on: ``name[ARGS]{...}``, one per ``[TOOL_CALLS]``, the arguments as the model wrote them.

Which form is told by what follows the first marker (a ``[`` or ``{``: the older one), where vLLM asks the tokenizer.

Calls that do not read leave the whole answer as content, as the other parsers here do. The ids are Mistral's, nine
letters and digits (its chat template refuses any other on the next turn). Streamed, the content goes out as it
comes (what may be the start of ``[TOOL_CALLS]`` held back); a call goes out once it reads whole: its name at
``[ARGS]`` and its arguments once their JSON is complete (v11 on), or both once its object is (before).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable

from scheduler_svc.api.http.tool_calls import Extracted, Streamed, tag_overlap
from scheduler_svc.api.http.tool_schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, arguments_json

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
ID_CHARACTERS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's tool call id: nine letters and digits."""
    return "".join(random.choices(ID_CHARACTERS, k=9))


def call_of(entry: object) -> FunctionCall | None:
    """One entry of a pre-v11 array as a call (None: no call object)."""
    if not isinstance(entry, dict) or not ({"name", "arguments"} & entry.keys()):
        return None
    name, arguments = entry.get("name"), entry.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = arguments_json(arguments)
    return FunctionCall(name=name if isinstance(name, str) else "", arguments=arguments)


def decoded(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at ``start`` (blanks skipped) and the index after it; None while it is not complete (or
    nests too deep to read)."""
    start = len(text) - len(text[start:].lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def is_v11(after: str) -> bool:
    """Whether the text after the first ``[TOOL_CALLS]`` is v11's ``name[ARGS]{...}`` (not a JSON array or object)."""
    return after.lstrip()[:1] not in ("[", "{")


def v11_calls(after: str, ended: bool) -> list[tuple[str, str | None]]:
    """Each ``name[ARGS]{...}`` after a marker that reached ``[ARGS]``: its name and its arguments' own text once
    complete (a value that may still grow, a number, only once the answer ``ended`` or a marker follows)."""
    calls: list[tuple[str, str | None]] = []
    segments = after.split(BOT)
    for k, segment in enumerate(segments):
        if not segment.strip():  # repeated markers count as one
            continue
        name, args, arguments = segment.partition(ARGS)
        if not args:
            break
        value = decoded(arguments, 0)
        settled = value is not None and (isinstance(value[0], (dict, list, str)) or ended or k < len(segments) - 1)
        calls.append((name.strip(), arguments[len(arguments) - len(arguments.lstrip()):value[1]] if settled else None))
    return calls


def array_calls(text: str) -> tuple[list[FunctionCall], bool]:
    """The calls of a pre-v11 array (or object) that read so far, and whether it is complete."""
    value = decoded(text, 0)
    if value is not None:
        entries = value[0] if isinstance(value[0], list) else [value[0]]
        return [call for call in map(call_of, entries) if call is not None], True
    body = text.lstrip()
    if not body.startswith("["):
        return [], False
    calls, pos = [], len(text) - len(body) + 1
    while (value := decoded(text, pos)) is not None:
        if (call := call_of(value[0])) is not None:
            calls.append(call)
        pos = value[1]
        rest = text[pos:].lstrip()
        if not rest.startswith(","):
            break
        pos = len(text) - len(rest) + 1
    return calls, False


class MistralParser:
    # [TOOL_CALLS] is a control token: the answer's text must keep it (vLLM's adjustment).
    keeps_special_tokens = True
    call_id = staticmethod(mistral_call_id)

    def __init__(self, new_id: Callable[[], str] = mistral_call_id) -> None:
        self.new_id = new_id
        self.text = ""
        self.content_sent = 0
        self.sent: list[tuple[bool, bool]] = []  # per call: its name sent, its arguments sent

    def whole(self, text: str) -> Extracted:
        if BOT not in text:
            return Extracted([], text)
        content, _, after = text.partition(BOT)
        if is_v11(after):
            read = v11_calls(after, ended=True)
            if len(read) != len([s for s in after.split(BOT) if s.strip()]) or any(a is None for _, a in read):
                return Extracted([], text)
            calls = [FunctionCall(name=name, arguments=arguments) for name, arguments in read]
        else:
            segment = next((s for s in after.split(BOT) if s.strip()), "")
            calls, complete = array_calls(segment)
            if not complete:
                calls = []
        if not calls:
            return Extracted([], text)
        return Extracted(calls, content if content.strip() else None)

    def feed(self, delta: str) -> Streamed | None:
        self.text += delta
        start = self.text.find(BOT)
        end = start if start >= 0 else len(self.text) - tag_overlap(self.text, BOT)
        content = None
        if end > self.content_sent:
            content, self.content_sent = self.text[self.content_sent:end], end
        deltas = [] if start < 0 else self.call_deltas(self.text[start + len(BOT):])
        return Streamed(content, deltas) if content or deltas else None

    def call_deltas(self, after: str) -> list[DeltaToolCall]:
        """What the calls read so far have not sent yet."""
        found: list[tuple[str | None, str | None]] = []  # (name, arguments) as far as each reads
        if is_v11(after):
            found = list(v11_calls(after, ended=False))
        else:
            segment = next((s for s in after.split(BOT) if s.strip()), "")  # repeated markers count as one
            found = [(call.name, call.arguments) for call in array_calls(segment)[0]]
        deltas = []
        for index, (name, arguments) in enumerate(found):
            if index == len(self.sent):
                self.sent.append((False, False))
            name_sent, arguments_sent = self.sent[index]
            if not name_sent and name is not None:
                deltas.append(DeltaToolCall(index=index, id=self.new_id(), type="function",
                                            function=DeltaFunctionCall(name=name)))
                name_sent = True
            if not arguments_sent and arguments is not None:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
                arguments_sent = True
            self.sent[index] = (name_sent, arguments_sent)
        return deltas

    def unsent_arguments(self) -> str:
        return ""
