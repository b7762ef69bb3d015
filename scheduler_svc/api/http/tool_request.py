"""A chat request's ``tools`` and ``tool_choice``, checked as vLLM checks them, and the JSON schema that enforces a
``"required"`` or named tool choice through structured outputs.

``tool_choice`` left out (or null) is ``"auto"`` when tools are given and ``"none"`` otherwise, as vLLM reads it.
``"auto"`` needs the scheduler's --enable-auto-tool-choice and --tool-call-parser (the answer is parsed for calls in
the model's own format); ``"required"`` and a named function need no parser: their output is held to vLLM's schema
(a JSON array of ``{"name", "parameters"}`` objects, or the named function's parameters) and read as that.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.tool_schemas import Tool

NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    """What a request asks of tool calling: ``kind`` is one of ``CHOICES`` or ``"named"`` (then ``name``)."""

    kind: str = "none"
    name: str = ""
    tools: tuple[Tool, ...] = ()
    # False: one call at most (vLLM's parallel_tool_calls); None and True: any number.
    parallel: bool | None = None

    @property
    def forced(self) -> bool:
        """The output is held to a tool-call schema, and read as one."""
        return self.kind in ("required", "named")


def refuse(message: str, param: str = "tool_choice") -> ApiError:
    return ApiError(400, f"{param}: {message}", param.split(".", 1)[0])


def tool_choice(tools: list[Tool] | None, choice: str | dict[str, Any] | None,
                parallel: bool | None = None) -> ToolChoice:
    """The request's tool choice, or a 400 saying what is wrong, in vLLM's words."""
    if tools is not None and not tools:
        raise refuse("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                     "entirely.", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none", tools=tuple(tools or ()), parallel=parallel)
    if tools is None:
        raise refuse("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise refuse(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                         "are supported.")
        return ToolChoice(choice, tools=tuple(tools), parallel=parallel)
    function = choice.get("function")
    if not isinstance(function, dict):
        raise refuse(f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}",
                     "tool_choice.function")
    if "name" not in function:
        raise refuse(f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}",
                     "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise refuse(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}",
                     "tool_choice.function.name")
    if all(tool.function.name != name for tool in tools):
        raise refuse("The tool specified in `tool_choice` does not match any of the specified `tools`")
    return ToolChoice("named", name, tuple(tools), parallel)


def parameters_or_empty_object(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool without parameters still takes a JSON object."""
    return parameters if parameters else {"type": "object", "properties": {}}


def forced_schema(choice: ToolChoice) -> dict[str, Any] | None:
    """vLLM's schema for a forced tool choice (None for "none" and "auto"): the named function's parameters, or an
    array of at least one call of any tool (at most one when parallel calls are off), every tool's ``$defs`` moved to
    the top where a ``$ref`` reaches them."""
    if choice.kind == "named":
        tool = next(tool for tool in choice.tools if tool.function.name == choice.name)
        return parameters_or_empty_object(tool.function.parameters)
    if choice.kind != "required":
        return None
    calls, defs = [], {}
    for tool in choice.tools:
        parameters = copy.deepcopy(tool.function.parameters)
        if parameters is not None:
            for name, schema in lifted_defs(parameters, tool.function.name).items():
                if name in defs and defs[name] != schema:
                    raise refuse(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
                defs[name] = schema
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters_or_empty_object(parameters)},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if choice.parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def lifted_defs(parameters: dict[str, Any], tool: str) -> dict[str, Any]:
    """The ``$defs`` taken out of one tool's parameters."""
    defs = parameters.pop("$defs", {})
    if not isinstance(defs, dict):
        raise refuse(f"`$defs` in the parameters of tool '{tool}' must be an object, got {type(defs).__name__}.",
                     "tools")
    return defs
