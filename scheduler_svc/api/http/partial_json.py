"""JSON that is still being generated, read as far as it goes: what a streaming tool-call parser needs to see a call's
name and arguments before the model closed them.

``loads`` reads a complete value, the first of several (with where it ends), or a cut one completed: open strings,
arrays and objects are closed where the text stops, a key without its value is dropped, a cut number or ``true`` /
``false`` / ``null`` reads as far as it goes. ``strings=False`` drops a cut string instead (a tool's name is sent
whole or not at all). Text that cannot begin valid JSON raises ``Malformed``.
"""

from __future__ import annotations

import json
import re

LITERALS = {"null": None, "true": True, "false": False, "Infinity": float("inf"), "-Infinity": float("-inf"),
            "NaN": float("nan")}
NUMBER_CHARS = frozenset("0123456789.-+eE")
# A cut escape at the end of an open string: \, \uXX.., \UXXXX...., \xX.
CUT_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\(?:u[0-9a-fA-F]{0,3}|U[0-9a-fA-F]{0,7}|x[0-9a-fA-F]?)?)$")


class Malformed(ValueError):
    """The text is not the beginning of a JSON value."""


class Missing:
    """A value cut before any of it could be read: left out of its array or object."""


MISSING = Missing()


def loads(text: str, strings: bool = True) -> tuple[object, int]:
    """The value ``text`` begins with, and how much of ``text`` it took (all of it when cut); ValueError (``Malformed``
    among them) when it cannot be the beginning of one."""
    try:
        return json.loads(text), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:
            return json.JSONDecoder().raw_decode(text)
    value, _ = Reader(text.strip(), strings).value(0)
    if value is MISSING:
        raise Malformed("nothing readable yet")
    return value, len(text)


class Reader:
    """A recursive descent over a prefix of JSON; each method returns the value (MISSING if none) and the index after
    it, and stops at the text's end."""

    def __init__(self, text: str, strings: bool) -> None:
        self.text, self.strings = text, strings

    def blank(self, i: int) -> int:
        while i < len(self.text) and self.text[i].isspace():
            i += 1
        return i

    def value(self, i: int) -> tuple[object, int]:
        i = self.blank(i)
        if i >= len(self.text):
            raise Malformed("no value")
        char = self.text[i]
        if char == '"':
            return self.string(i)
        if char == "[":
            return self.array(i)
        if char == "{":
            return self.object(i)
        rest = self.text[i:]
        if rest == "-":
            return MISSING, len(self.text)
        if char.isdigit() or char == "-" and rest[1] != "I":
            return self.number(i)
        for literal, value in LITERALS.items():
            if rest.startswith(literal):
                return value, i + len(literal)
            if literal.startswith(rest):
                return value, len(self.text)
        raise Malformed(f"unexpected character {char!r}")

    def string(self, i: int) -> tuple[object, int]:
        j = i + 1
        while j < len(self.text):
            if self.text[j] == "\\":
                j += 2
                continue
            if self.text[j] == '"':
                return json.loads(self.text[i:j + 1]), j + 1
            j += 1
        if not self.strings:
            return MISSING, len(self.text)
        body = self.text[i + 1:]
        cut = CUT_ESCAPE.search(body)
        if cut and cut.group(1):
            body = body[:cut.start(1)]
        return json.loads(f'"{body}"'), len(self.text)

    def number(self, i: int) -> tuple[object, int]:
        j = i + 1
        while j < len(self.text) and self.text[j] in NUMBER_CHARS:
            j += 1
        end = j
        while end > i and self.text[end - 1] in ".-+eE":
            end -= 1
        if end == i:
            return MISSING, len(self.text)
        return json.loads(self.text[i:end]), j

    def array(self, i: int) -> tuple[object, int]:
        items: list[object] = []
        j = self.blank(i + 1)
        if j < len(self.text) and self.text[j] == "]":
            return items, j + 1
        while j < len(self.text):
            item, j = self.value(j)
            if item is not MISSING:
                items.append(item)
            j = self.blank(j)
            if j >= len(self.text):
                break
            if self.text[j] == "]":
                return items, j + 1
            if self.text[j] != ",":
                raise Malformed(f"expected ',' or ']', got {self.text[j]!r}")
            j = self.blank(j + 1)
        return items, len(self.text)

    def object(self, i: int) -> tuple[object, int]:
        out: dict[str, object] = {}
        j = self.blank(i + 1)
        while j < len(self.text):
            if self.text[j] == "}":
                return out, j + 1
            if self.text[j] != '"':
                raise Malformed(f"expected a key, got {self.text[j]!r}")
            key, j = Reader(self.text, False).string(j)
            j = self.blank(j)
            if key is MISSING or j >= len(self.text):
                break
            if self.text[j] != ":":
                raise Malformed(f"expected ':', got {self.text[j]!r}")
            j = self.blank(j + 1)
            if j >= len(self.text):
                break
            value, j = self.value(j)
            if value is not MISSING:
                out[key] = value
            j = self.blank(j)
            if j >= len(self.text):
                break
            if self.text[j] == "}":
                return out, j + 1
            if self.text[j] != ",":
                raise Malformed(f"expected ',' or '}}', got {self.text[j]!r}")
            j = self.blank(j + 1)
        return out, len(self.text)
