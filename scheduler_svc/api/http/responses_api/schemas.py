"""OpenAI's Responses API shapes, as vLLM serves them: the request (with vLLM's extra sampling parameters), the
``response`` object and its output items, and the streamed events.

Input items stay plain objects here: ``inputs`` reads them one by one, so that a bad one is refused naming its
place (``input[2].call_id``) rather than with every alternative a union of item types would list.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.api.http.schemas import CacheSalt, Omitted, Request, StructuredOutputs, TokenLogprob, UInt32

# What ``include`` may ask for (OpenAI's list); only the logprobs change an answer of this server.
Includable = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                     "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
                     "reasoning.encrypted_content", "web_search_call.action.sources", "web_search_call.results"]
LOGPROBS = "message.output_text.logprobs"
Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionTool(Request):
    """A function the model may call; the Responses API's other tools (web search, MCP, ...) need a tool server."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: UInt32 | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's: false leaves the thinking out of the output.
    include_reasoning: bool = True
    include: list[Includable] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    # vLLM's extra parameters, as on its chat completions.
    top_k: Annotated[int, Field(ge=-1, lt=2**32)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[UInt32] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None
    cache_salt: CacheSalt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: the response's id (a fresh "resp_..." when unset).
    request_id: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = Omitted


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = Omitted
    status: Literal["in_progress", "completed", "incomplete"] | None = Omitted


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object: what a request asked (echoed), where it stands, and its output."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: Usage | None = None
    user: str | None = None


class Event(BaseModel):
    """One streamed event; its fields besides these depend on its ``type`` (OpenAI's event reference)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
