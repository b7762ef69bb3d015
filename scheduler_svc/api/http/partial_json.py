"""JSON that is still being generated, read as far as it goes: what a streaming tool-call parser needs to see a call's
name and arguments before the model closed them. The reading is ``partial_json_parser``'s (vLLM's own choice)."""

from __future__ import annotations

import json

from partial_json_parser import Allow
from partial_json_parser import loads as complete_and_load


class Malformed(ValueError):
    """The text is not the beginning of a JSON value."""


def loads(text: str, strings: bool = True) -> tuple[object, int]:
    """The value ``text`` begins with, and how much of ``text`` it took (all of it when cut: open strings, arrays and
    objects closed where the text stops); ``strings=False`` drops a cut string instead (a tool's name is sent whole
    or not at all). ``Malformed`` when the text cannot begin a JSON value."""
    try:
        return complete_and_load(text, Allow.ALL if strings else Allow.ALL & ~Allow.STR), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:  # a whole value, then more: the first one and where it ends
            return json.JSONDecoder().raw_decode(text)
        raise Malformed(str(e)) from e
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise Malformed(f"not the beginning of a JSON value: {e}") from e
