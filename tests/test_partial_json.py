"""``partial_json.loads`` reads every prefix of a JSON text exactly as ``partial_json_parser`` (vLLM's reading) does,
its fast path for a text that stops inside a string value included; and the library (a Python scan a character) is
left to what only it reads, so that a long argument does not cost its length at every delta."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from partial_json_parser import Allow
from partial_json_parser import loads as library_loads

from scheduler_svc.api.http import partial_json
from scheduler_svc.api.http.tool_calls import Llama3JsonParser

TEXT = st.text(st.sampled_from('ab"\\/\n\t é€😀{}[]:,u0'), max_size=8)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | TEXT,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                      max_leaves=8)


def library(text: str) -> object:
    try:
        return library_loads(text, Allow.ALL)
    except Exception as e:  # what the library raises is ours to rename; only that it refuses counts
        return type(e)


def ours(text: str) -> object:
    try:
        return partial_json.loads(text)[0]
    except partial_json.Malformed:
        return "refused"


@settings(max_examples=150, deadline=None)
@given(VALUES.filter(lambda v: isinstance(v, dict | list)), st.booleans())
def test_every_prefix_reads_as_the_library_reads_it(value: object, ascii_only: bool):
    text = json.dumps(value, ensure_ascii=ascii_only)
    for end in range(1, len(text) + 1):
        prefix = text[:end]
        expected = library(prefix)
        got = ours(prefix)
        if isinstance(expected, type):  # the library refused (or broke): so do we
            assert got == "refused", prefix
        else:
            assert got == expected, prefix


def test_a_long_string_value_is_read_without_the_library(monkeypatch):
    """The library scans a string in Python, character by character: at every delta of a long argument it read the
    whole text again (a 40 kB call took a minute to stream). Here it reads only what ``json`` cannot: none of these."""
    calls = []
    monkeypatch.setattr(partial_json, "complete_and_load", lambda *a: calls.append(a) or library_loads(*a))
    text = json.dumps({"name": "write", "parameters": {"path": "a.py", "content": "x = 1\n\u00e9\\" * 300}})
    reader = Llama3JsonParser(lambda: "id")
    start = text.index('"content": "') + len('"content": "') + 1
    end = text.rindex('"')  # the long string's closing quote
    sent = "".join(call.function.arguments or "" for i in range(0, len(text), 3)
                   for out in [reader.feed(text[i:i + 3])] if out for call in out.calls if call.function)
    assert json.loads(sent) == json.loads(text)["parameters"]
    assert not [c for c in calls if start + 6 < len(c[0]) <= end]  # nor any text stopping inside the long string
