"""Tool calling's shapes, as vLLM's OpenAI server takes and answers them: the request's ``tools`` and the answer's
``tool_calls`` (whole, and as streamed deltas). ``schemas`` builds its messages and requests from these.

Optional delta fields are left out when None: a streamed tool call names its ``id``, ``type`` and function ``name``
once, in its first delta, and only ``arguments`` after that.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Omitted = Field(default=None, exclude_if=lambda value: value is None)
# A lone UTF-16 surrogate: JSON can spell one ("\ud800"), and json.loads gives it back, but no UTF-8 answer carries it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def arguments_json(value: object) -> str:
    """A call's arguments as JSON text, non-ASCII kept as vLLM writes them; a lone surrogate a model wrote stays the
    escape it wrote (written raw, it made the whole answer fail)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode()  # as a rule it encodes: checked faster than searched (a long argument is read at every delta)
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """What vLLM hands the chat template: its fields alone, ``strict`` and ``defer_loading`` only when set."""
        out: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        for name in ("strict", "defer_loading"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as the chat template's ``tools`` holds it (vLLM's dump: a tool-level ``defer_loading`` is the
        function's too)."""
        function = self.function.template_dict()
        out: dict[str, Any] = {"type": self.type, "function": function}
        if self.defer_loading is not None:
            function.setdefault("defer_loading", self.defer_loading)
            out["defer_loading"] = self.defer_loading
        return out


class FunctionCall(BaseModel):
    name: str
    # The arguments as JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = Omitted
    arguments: str | None = Omitted


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = Omitted
    type: Literal["function"] | None = Omitted
    function: DeltaFunctionCall | None = Omitted


class CompletionTokensDetails(BaseModel):
    """vLLM's, with --reasoning-parser: how many of the completion's tokens were its reasoning."""

    reasoning_tokens: int = 0
