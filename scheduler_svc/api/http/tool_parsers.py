"""``--tool-call-parser``'s choices by vLLM's names: each reads one choice's answer for calls, ``whole`` (a finished
text) or ``feed`` (delta by delta), and says whether the answer's text must keep special tokens; a ``call_id`` of its
own is the ids its model's template takes back (else ``chat_output.new_tool_call_id``)."""

from __future__ import annotations

from scheduler_svc.api.http.tool_calls import HermesParser, Llama3JsonParser
from scheduler_svc.api.http.tool_mistral import MistralParser
from scheduler_svc.api.http.tool_pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser] | type[PythonicParser] | type[MistralParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser, "mistral": MistralParser}
