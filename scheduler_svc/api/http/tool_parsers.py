"""``--tool-call-parser``'s choices by vLLM's names: each reads one choice's answer for calls, ``whole`` (a finished
text) or ``feed`` (delta by delta), and says whether the answer's text must keep special tokens."""

from __future__ import annotations

from scheduler_svc.api.http.tool_calls import HermesParser, Llama3JsonParser
from scheduler_svc.api.http.tool_pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser] | type[PythonicParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser}
