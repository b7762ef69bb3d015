"""``--tool-call-parser pythonic`` (Llama 3.2, Llama 4, ToolACE): the answer is a Python list of calls,
``[get_weather(city='Paris', days=3), get_time()]``, read as vLLM's parser of that name reads it.

An answer that starts otherwise, or that turns out not to be such a list, is content, whole and streamed alike. A
call's name may be dotted (``weather.get``); its arguments are its keyword arguments as a JSON object, each a literal
(strings, numbers, ``True``/``False``/``None`` or JSON's ``true``/``false``/``null``, lists, tuples and sets as
lists, dicts); positional ones are left out, as vLLM leaves them. Streamed, a call is announced once ``(`` follows
its name, and its arguments go out as far as they can no longer change: each keyword argument whose value ended,
and the string a value is still writing; the rest when the call closes.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.api.http.tool_calls import Extracted, Streamed
from scheduler_svc.api.http.tool_schemas import DeltaFunctionCall, DeltaToolCall, FunctionCall, arguments_json

OPENING, CLOSING = "([{", ")]}"
# An escape at a string's end that more characters may still change: \1 (\12, \123), \x4, \u00e, \N{LATIN...
UNFINISHED_ESCAPE = re.compile(r"\\(?:[0-7]{1,2}|x[0-9a-fA-F]?|u[0-9a-fA-F]{0,3}|U[0-9a-fA-F]{0,7}|N(?:\{[^}]*)?)?$")
JSON_NAMES = {"true": True, "false": False, "null": None}
# The longest such escape: \N{...} with the longest name Unicode has (88 characters).
ESCAPE_WINDOW = 128


class NotCalls(ValueError):
    """The text is not (the beginning of) a list of calls."""


def value_of(node: ast.expr) -> object:
    """A keyword argument's value as JSON holds it; NotCalls for anything but a literal."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and (k.value is None or isinstance(
            k.value, (str, int, float))) for k in node.keys):
        return {k.value: value_of(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [value_of(e) for e in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(str(part.value) for part in node.values)
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = value_of(node.operand)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    raise NotCalls(f"not a literal: {ast.dump(node)}")


def literal(source: str) -> object:
    try:
        return value_of(ast.parse(source.strip(), mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise NotCalls(f"not a literal: {source!r}") from e


def dotted_name(node: ast.expr) -> str:
    """``a.b.c`` for a call of ``a.b.c(...)``; NotCalls for any other callee."""
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    raise NotCalls("a call of something other than a name")


@dataclass
class Call:
    """One call read so far: its keyword arguments whose values ended, the one being written (its keyword and value
    text so far), and whether ``)`` closed it."""

    name: str
    arguments: list[tuple[str, object]] = field(default_factory=list)
    open_keyword: str | None = None
    open_value: str = ""
    closed: bool = False

    def settled_json(self) -> str:
        """The arguments' JSON as far as it cannot change: all of it once closed."""
        parts = [f"{arguments_json(k)}: {arguments_json(v)}" for k, v in self.arguments]
        if self.closed:
            return "{" + ", ".join(parts) + "}"
        partial = partial_string(self.open_value) if self.open_keyword is not None else None
        if partial is not None:
            parts.append(f"{arguments_json(self.open_keyword)}: {partial}")
        return "{" + ", ".join(parts)


def partial_string(value: str) -> str | None:
    """The JSON of a string literal still being written, without its closing quote, as far as it cannot change (up
    to an escape that may still be going on: ``\\12`` may become ``\\123``); None if ``value`` is not one."""
    value = value.lstrip()
    quote = value[:1]
    if quote not in ("'", '"') or value.startswith(quote * 3):
        return None
    body = value[1:]
    tail = max(len(body) - ESCAPE_WINDOW, 0)  # an escape still going on is at the end: the rest is not searched
    body = body[:tail] + UNFINISHED_ESCAPE.sub("", body[tail:])
    if (len(body) - len(body.rstrip("\\"))) % 2:
        return None
    try:
        text = ast.literal_eval(quote + body + quote)
    except (ValueError, SyntaxError):
        return None
    return arguments_json(text)[:-1] if isinstance(text, str) else None


# A string literal's body after its opening quote, up to its closing quote or the text's end, by quote.
STRING_BODIES = {**{q: re.compile(rf"[^\\{q}]*(?:\\.[^\\{q}]*)*", re.DOTALL) for q in "'\""},
                 **{q * 3: re.compile(rf"(?:[^\\{q}]|\\.|{q}(?!{q}{q}))*", re.DOTALL) for q in "'\""}}


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def name_end(text: str, i: int) -> int:
    """The end of the (dotted) name starting at ``i``."""
    while i < len(text) and (text[i].isalnum() or text[i] in "_."):
        i += 1
    return i


def skip_string(text: str, i: int) -> int:
    """The index after the string literal whose quote is ``text[i]``; len(text) while it is not closed. Found by a
    regular expression (a long argument, read again at every delta, cost a Python step a character)."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    end = STRING_BODIES[quote].match(text, i + len(quote)).end()  # as far as it goes: it never fails, never backtracks
    return end + len(quote) if text.startswith(quote, end) else len(text)


def value_end(text: str, i: int) -> int:
    """Where the value starting at ``i`` ends (at a ``,`` or ``)`` outside brackets and strings); len(text) while it
    has not."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c in "'\"":
            i = skip_string(text, i)
            continue
        if c in OPENING:
            depth += 1
        elif c in CLOSING:
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return len(text)


def read_calls(text: str) -> tuple[list[Call], bool]:
    """The calls of ``text``, which starts with ``[``, as far as it goes, and whether it broke off there (it cannot
    be a list of calls: NotCalls if that shows before any call). What follows the list's ``]`` is not read."""
    calls: list[Call] = []
    i = skip_space(text, 1)
    try:
        while i < len(text):
            if text[i] == "]" and calls:  # after a trailing comma
                return calls, False
            end = name_end(text, i)
            opening = skip_space(text, end)
            if opening == len(text):
                return calls, False
            name = unicodedata.normalize("NFKC", text[i:end])  # as Python reads an identifier
            if text[opening] != "(" or not all(part.isidentifier() for part in name.split(".")):
                raise NotCalls(f"no call at {i}")
            call = Call(name)
            calls.append(call)
            i = skip_space(text, read_arguments(text, skip_space(text, opening + 1), call))
            if i == len(text) or text[i] == "]":
                return calls, False
            if text[i] != ",":
                raise NotCalls(f"{text[i]!r} after a call")
            i = skip_space(text, i + 1)
    except NotCalls:
        if not calls:
            raise
        return calls, True
    return calls, False


def read_arguments(text: str, i: int, call: Call) -> int:
    """Read ``call``'s arguments from ``i``, after its ``(``; the index after its ``)``, or len(text)."""
    while i < len(text):
        if text[i] == ")":
            call.closed = True
            return i + 1
        end = name_end(text, i)
        equals = skip_space(text, end)
        if equals == len(text):
            return equals
        keyword = unicodedata.normalize("NFKC", text[i:end])
        value = value_end(text, equals + 1 if text[equals] == "=" else i)
        if text[equals] == "=" and keyword.isidentifier():
            if keyword in dict(call.arguments):
                raise NotCalls(f"keyword argument repeated: {keyword}")
            if value == len(text):
                call.open_keyword, call.open_value = keyword, text[equals + 1:]
                return value
            call.arguments.append((keyword, literal(text[equals + 1:value])))
        elif value == len(text):  # a positional argument, left out once it ends
            return value
        i = value if text[value] == ")" else skip_space(text, value + 1)
    return len(text)


class PythonicParser:
    keeps_special_tokens = False

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.text = ""
        # None while the answer may be calls; then "content" (it is not) or "ended" (calls went out, then it broke).
        self.read_as: str | None = None
        self.args_sent: list[str] = []

    def whole(self, text: str) -> Extracted:
        """The calls, or none (and the text as content) unless the answer is a list of calls."""
        if not text.startswith("["):
            return Extracted([], text)
        try:
            module = ast.parse(text).body  # a module, as vLLM reads it: a ";" may end it
            body = module[0].value if len(module) == 1 and isinstance(module[0], ast.Expr) else None
            if not isinstance(body, ast.List) or not body.elts or not all(
                    isinstance(e, ast.Call) and len({k.arg for k in e.keywords}) == len(e.keywords) for e in body.elts):
                return Extracted([], text)  # a repeated keyword argument is no Python either
            calls = [FunctionCall(name=dotted_name(e.func), arguments=arguments_json(
                {k.arg: value_of(k.value) for k in e.keywords if k.arg is not None})) for e in body.elts]
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return Extracted([], text)
        return Extracted(calls, None)

    def feed(self, delta: str) -> Streamed | None:
        """Content unless the answer starts ``[`` and reads as calls; each call's name once ``(`` follows it, and
        its arguments as far as they are settled."""
        self.text += delta
        if self.read_as is not None or not self.text:
            return Streamed(content=delta) if self.read_as == "content" and delta else None
        try:
            if not self.text.startswith("["):
                raise NotCalls("no list")
            calls, broken = read_calls(self.text)
        except NotCalls:  # not calls after all: content, what was held back included
            self.read_as = "content"
            return Streamed(content=self.text)
        if broken:  # after calls: those read go out, the rest is dropped (``whole`` reads no calls at all there)
            self.read_as = "ended"
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(calls):
            if index == len(self.args_sent):
                self.args_sent.append("")
                deltas.append(DeltaToolCall(index=index, id=self.new_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name)))
            sent, settled = self.args_sent[index], call.settled_json()
            if len(settled) > len(sent) and settled.startswith(sent):
                self.args_sent[index] = settled
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=settled[len(sent):])))
        return Streamed(calls=deltas) if deltas else None

    def unsent_arguments(self) -> str:
        """Nothing: a call's arguments go out in full once it closes, and an unclosed call's are not settled."""
        return ""
