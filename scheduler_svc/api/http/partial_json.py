"""JSON that is still being generated, read as far as it goes: what a streaming tool-call parser needs to see a call's
name and arguments before the model closed them. The reading is ``partial_json_parser``'s (vLLM's own choice), but
for text that stops inside a string value (a long argument as it is written, the common case), which is closed and
read by ``json`` itself: the library scans it character by character in Python, and a parser reads the whole text
again at every delta, which made a call of 40 kB take a minute to stream."""

from __future__ import annotations

import json
import re

from partial_json_parser import Allow
from partial_json_parser import loads as complete_and_load


class Malformed(ValueError):
    """The text is not the beginning of a JSON value."""


# A string, closed or cut (then to the end, a dangling backslash with it), or a bracket: what the closing needs.
TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
CLOSERS = {"{": "}", "[": "]"}
# A unicode escape's start at a string's end (an escape where an odd run of backslashes ends in its backslash).
HALF_UNICODE = re.compile(r"\\u[0-9a-fA-F]{0,3}\Z")


def in_string_value(text: str) -> tuple[int, str] | None:
    """Where ``text`` stops inside a string that is a value (not a key): how many characters at its end are an escape
    half written (dropped, as the library drops them), and what closes the rest; else None."""
    stack: list[str] = []
    last = None
    for token in TOKENS.finditer(text):
        kind = token.group()[0]
        if kind in CLOSERS:
            stack.append(kind)
        elif kind != '"':
            if not stack:
                return None
            stack.pop()
        last = token
    if last is None or last.group()[0] != '"' or last.end() != len(text) or not stack:
        return None
    body = last.group()
    if len(body) > 1 and body.endswith('"') and (len(body) - len(body[:-1].rstrip("\\")) - 1) % 2 == 0:
        return None  # closed right at the end
    before = text[:last.start()].rstrip()[-1:]
    if not (before == ":" or (stack[-1] == "[" and before in "[,")):
        return None  # a key
    return half_escape(body), '"' + "".join(CLOSERS[c] for c in reversed(stack))


def half_escape(body: str) -> int:
    """How many characters at the end of a cut string are an escape half written: a backslash that escapes nothing
    yet, or a unicode escape short of its four digits."""
    unicode = HALF_UNICODE.search(body[-5:])
    head = body[:len(body) - len(unicode.group()) + 1] if unicode is not None else body
    if (len(head) - len(head.rstrip("\\"))) % 2 == 0:
        return 0
    return len(unicode.group()) if unicode is not None else 1


def loads(text: str, strings: bool = True) -> tuple[object, int]:
    """The value ``text`` begins with, and how much of ``text`` it took (all of it when cut: open strings, arrays and
    objects closed where the text stops); ``strings=False`` drops a cut string instead (a tool's name is sent whole
    or not at all). ``Malformed`` when the text cannot begin a JSON value."""
    stripped = text.rstrip()  # as the library reads it: a string's last blanks wait for what follows them
    if strings and text.startswith(("{", "[")) and (cut := in_string_value(stripped)) is not None:
        try:
            return json.loads(stripped[:len(stripped) - cut[0]] + cut[1]), len(text)
        except json.JSONDecodeError:
            pass  # a \u escape half written, say: the library reads it
    try:
        return complete_and_load(text, Allow.ALL if strings else Allow.ALL & ~Allow.STR), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:  # a whole value, then more: the first one and where it ends
            return json.JSONDecoder().raw_decode(text)
        raise Malformed(str(e)) from e
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise Malformed(f"not the beginning of a JSON value: {e}") from e
