"""Anthropic's Messages API shapes, as vLLM serves them: the request (with vLLM's ``top_k`` and
``chat_template_kwargs``), the message answered, and the error object. Content blocks stay plain objects: ``inputs``
reads them one by one, naming a bad one by its place (``messages[1].content[0]``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from scheduler_svc.api.http.schemas import CacheSalt, Omitted, Request, UInt32


class Message(Request):
    role: Literal["user", "assistant", "system"]
    content: str | list[Any]


class Tool(Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    # Claude Code's tool search: a tool whose definition the template may leave out until it is wanted.
    defer_loading: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def an_object_by_default(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """vLLM's: a schema without a type is an object's."""
        return schema if "type" in schema else {"type": "object", **schema}


class ToolChoice(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Request):
    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic's and vLLM's floor; under --reasoning-parser the thinking's budget (vLLM's thinking_token_budget).
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None


class OutputFormat(Request):
    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(Request):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(Request):
    model: str
    messages: list[Message]
    system: str | list[Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # vLLM's: more variables for the chat template.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: UInt32
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's: the prefix cache's salt, as on the chat route.
    cache_salt: CacheSalt | None = None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = Omitted


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokens(BaseModel):
    input_tokens: int

