"""OpenAI's request and response shapes (and vLLM's extra request parameters), as pydantic models.

Requests allow extra fields: an unknown parameter is ignored, as OpenAI's API does; ``translate`` refuses
the few that would silently change the output. Integers the proto holds unsigned are bounded here, so
an out-of-range one is a 400 naming its parameter. Optional response fields that OpenAI leaves out
when unused (a delta's role, vLLM's token_ids, usage on a chunk) are left out when None.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from scheduler_svc.api.http.tool_schemas import CompletionTokensDetails, DeltaToolCall, Tool, ToolCall

UInt32 = Annotated[int, Field(ge=0, lt=2**32)]
# vLLM's cache_salt: the prefix cache's salt, non-empty when sent (the scheduler checks its length and characters).
CacheSalt = Annotated[str, Field(min_length=1)]
# vLLM's thinking_token_budget: a whole number of tokens, -1 for none (as left out).
ThinkingBudget = Annotated[StrictInt, Field(ge=-1, lt=2**32)]
Omitted = Field(default=None, exclude_if=lambda value: value is None)


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(Request):
    include_usage: bool | None = False
    # vLLM's: every chunk carries its choice's usage so far.
    continuous_usage_stats: bool | None = False


class JsonSchema(Request):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(Request):
    """vLLM's ``structured_outputs``: at most one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GenerationParameters(Request):
    """What both completion endpoints take: OpenAI's parameters, then vLLM's."""

    # Left out: the base model, as vLLM serves it.
    model: str | None = None
    max_tokens: UInt32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: UInt32 | None = None
    stop: str | list[str] | None = None
    # vLLM's range, a signed 64-bit integer (a negative seed samples as its unsigned twin).
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's spec lets a client send null for every boolean: it reads as false.
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra parameters. top_k -1 disables, as vLLM spells it.
    top_k: Annotated[int, Field(ge=-1, lt=2**32)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: UInt32 | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop_token_ids: list[UInt32] | None = None
    # -1: the model's length, as vLLM reads it.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, lt=2**32)] | None = None
    # vLLM's: "right" keeps the prompt's first truncate_prompt_tokens instead of its last.
    truncation_side: Literal["left", "right"] | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool | None = False
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    # The prompt tokens' logprobs, with this many alternatives each (vLLM's; not streamed, as there).
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Lower first under the scheduler's --request-order priority (vLLM's; only 0 otherwise).
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None
    # vLLM's: the answer's id is <prefix>-<request_id> (the X-Request-Id header's value in its place), random if left
    # out; a list of prompts' requests are <id>-0, <id>-1, ...
    request_id: str | None = None
    # vLLM's: logprobs name their tokens token_id:<id> (a token that is no whole character stays exact); left out, the
    # server's --return-tokens-as-token-ids decides.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: tokens a streamed choice gathers per chunk; it may raise the server's --stream-interval, not lower it.
    stream_interval: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    # vLLM's: a prompt salted so hits only blocks computed for requests of the same salt (a tenant's secret).
    cache_salt: CacheSalt | None = None
    # vLLM's: the most tokens the model may think (--reasoning-parser's markers); then </think> is forced.
    thinking_token_budget: ThinkingBudget | None = None
    # vLLM's: the alternatives each token's logprobs list are these tokens' (with logprobs asked for).
    logprob_token_ids: list[UInt32] | None = None
    repetition_detection: RepetitionDetection | None = None
    # vLLM's beam search: n beams, each answer scored by its summed logprob over its length ** length_penalty (1).
    use_beam_search: bool | None = False
    length_penalty: float | None = None


class RepetitionDetection(BaseModel):
    """vLLM's repetition_detection: the completion ends once a pattern of min_pattern_size (0: 1) to max_pattern_size
    tokens (0: off) repeats min_count times in a row at its end. Unknown keys are refused, as vLLM's."""

    model_config = ConfigDict(extra="forbid")

    max_pattern_size: UInt32 = 0
    min_pattern_size: UInt32 = 0
    min_count: UInt32 = 0


class TextPart(Request):
    type: str
    text: str | None = None


class Message(Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's earlier calls ({"id", "type", "function": {"name", "arguments"}}) and a tool's answer to one.
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    # An assistant's earlier thinking (vLLM's name, and its older one), for templates that show it.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(GenerationParameters):
    messages: list[Message]
    max_completion_tokens: UInt32 | None = None
    logprobs: bool | None = False
    top_logprobs: UInt32 | None = None
    tools: list[Tool] | None = None
    functions: list[Any] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name"}}; checked as vLLM checks it.
    tool_choice: str | dict[str, Any] | None = None
    # False: at most one tool call (vLLM's).
    parallel_tool_calls: bool | None = None
    # vLLM's: false leaves the reasoning (--reasoning-parser) out of the answer.
    include_reasoning: bool | None = None
    # OpenAI's; vLLM hands it to the chat template, and "none" turns Qwen3's enable_thinking off.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_generation_prompt: bool | None = None
    # vLLM's: the final message left open for the model to continue; echo puts an assistant's final message before
    # the answer.
    continue_final_message: bool | None = None
    echo: bool | None = None
    # vLLM's: more variables for the chat template, such as {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt the chat template made comes back as prompt_text (streamed: on the first chunk).
    return_prompt_text: bool | None = None
    # vLLM's: a chat template of the request's own, taken only with the server's --trust-request-chat-template.
    chat_template: str | None = None
    # vLLM's: documents for a template that does retrieval-augmented generation (its `documents`), each a dict such as
    # {"title": ..., "text": ...}; a template that reads none ignores them.
    documents: list[dict[str, str]] | None = None


class CompletionRequest(GenerationParameters):
    prompt: str | list[str] | list[UInt32] | list[list[UInt32]]
    logprobs: UInt32 | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = None


class CompletionRenderRequest(CompletionRequest):
    """vLLM's /v1/completions/render: a completion request whose prompts are only tokenized."""


class ChatCompletionRenderRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/render: the conversation rendered with the chat template and tokenized."""


class TokenizeRequest(Request):
    """vLLM's /tokenize: a text ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the final message left open, the tools the template lists, and the tokens' vocabulary strings back.
    continue_final_message: bool | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[UInt32]


# Responses.


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Omitted


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Omitted
    # vLLM's: the thinking --reasoning-parser took out of the content.
    reasoning: str | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a prompt token's, or an alternative's; ``rank`` 1 is the most likely (null where the token
    is not among the alternatives scored)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: null for the first prompt token, then each token's and its alternatives' by token id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string matched, or the stop token id sampled (null for EOS or any other finish).
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Omitted


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None = Omitted
    # vLLM's, with return_token_ids: the prompt's token ids (on a stream's first chunk).
    prompt_token_ids: list[int] | None = Omitted
    # vLLM's, with return_prompt_text: the prompt as the chat template made it (on a stream's first chunk).
    prompt_text: str | None = Omitted


class Delta(BaseModel):
    role: str | None = Omitted
    content: str | None = Omitted
    reasoning: str | None = Omitted
    tool_calls: list[DeltaToolCall] | None = Omitted


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Omitted


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = Omitted
    prompt_token_ids: list[int] | None = Omitted
    prompt_text: str | None = Omitted


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # None for the first token of an echoed prompt, which has no logprob.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Omitted
    prompt_logprobs: PromptLogprobs | None = Omitted
    # vLLM's, with return_token_ids: the choice's prompt's token ids (streamed: on the choice's first chunk).
    prompt_token_ids: list[int] | None = Omitted


class TextCompletion(BaseModel):
    """A whole completion, or (``usage`` left out) one streamed chunk of it: both are ``text_completion``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = Omitted


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanoserve"
    # A LoRA adapter's folder and base model (vLLM's fields); the base model is its own root, with no parent.
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body; ``load_inplace`` replaces the adapter served under ``lora_name``."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Omitted


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
