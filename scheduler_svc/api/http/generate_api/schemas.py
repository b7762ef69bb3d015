"""The bodies of ``/inference/v1/generate`` and ``/inference/v1/abort_requests``, as vLLM 0.32 spells them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from scheduler_svc.api.http.schemas import (
    CacheSalt,
    ChatLogprobs,
    CompletionUsage,
    Omitted,
    PromptLogprobs,
    RepetitionDetection,
    Request,
    StreamOptions,
    StructuredOutputs,
    ThinkingBudget,
    UInt32,
)


class SamplingParams(Request):
    """vLLM's ``SamplingParams`` as JSON, with its defaults (not the model's: vLLM's generate route fills only
    ``max_tokens``, which left out or null is the room the prompt leaves, capped by the model's own default)."""

    n: Annotated[int, Field(ge=1, lt=2**32)] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: no top-k.
    top_k: Annotated[int, Field(ge=-1, lt=2**32)] = 0
    min_p: float = 0.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[UInt32] | None = None
    ignore_eos: bool = False
    max_tokens: UInt32 | None = None
    min_tokens: UInt32 = 0
    logprobs: UInt32 | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Tokens per streamed chunk (vLLM's; the server's --stream-interval when left out).
    stream_interval: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    structured_outputs: StructuredOutputs | None = None
    # Token id -> bias; JSON's keys are strings.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: ThinkingBudget | None = None
    repetition_detection: RepetitionDetection | None = None


class GenerateRequest(Request):
    """The prompt as token ids and how to sample; ``output_mode`` ``text`` adds the decoded text."""

    # Left out: a random one. The answer's id is ``generate-tokens-<request_id>`` (the X-Request-Id header's value
    # in its place when sent), which /inference/v1/abort_requests takes with or without the prefix.
    request_id: str | None = None
    token_ids: list[UInt32] = Field(min_length=1)
    sampling_params: SamplingParams
    # Left out: the base model; a LoRA adapter's name runs through it.
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    # The prompt's token ids come back (streamed: on the first chunk).
    return_token_ids: bool | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    # True: structured_outputs constrain from the first token generated, the thinking over (as the render says);
    # else, under the scheduler's --reasoning-parser, from the end of the thinking unless the prompt closed it.
    reasoning_ended: bool | None = None
    # The prefix cache's salt: its prompt hits only blocks computed for requests of the same salt.
    cache_salt: CacheSalt | None = None


class GenerateLogProb(BaseModel):
    """A candidate by token id; ``rank`` 1 is the most likely (null where it is not known)."""

    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    """The sampled token, and the candidates as vLLM lists them: the sampled token first, then the others by rank."""

    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(BaseModel):
    index: int
    # stop, length or abort; in a stream null until the choice's last chunk.
    finish_reason: str | None = None
    # The stop string or stop token id that ended a ``stop`` (null for EOS).
    stop_reason: int | str | None = None
    token_ids: list[int]
    # ``output_mode`` text: the decoded text (a stream's chunk: what it adds), without a matched stop string
    # unless include_stop_str_in_output.
    text: str | None = Omitted
    # Tokens mode: by token id; text mode: the chat completion's shape.
    logprobs: GenerateLogProbs | ChatLogprobs | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    created: int
    output_mode: Literal["tokens", "text"]
    choices: list[GenerateChoice]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class GenerateChunk(BaseModel):
    """One server-sent event of a stream: one choice's new tokens, or (``choices`` empty) the usage at the end."""

    request_id: str
    output_mode: Literal["tokens", "text"]
    choices: list[GenerateChoice]
    usage: CompletionUsage | None = None
    prompt_token_ids: list[int] | None = Omitted


class RenderedSamplingParams(BaseModel):
    """The sampling and stopping parameters the request would run with, defaults filled in (vLLM's names)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    logprobs: int | None
    prompt_logprobs: int | None
    # Whether a grammar (response_format or structured_outputs) constrains the output.
    structured_output: bool
    # That constraint, as vLLM's structured_outputs (json, regex, choice, grammar or json_object).
    structured_outputs: dict[str, Any] | None = Omitted
    allowed_token_ids: list[int] | None = Omitted
    bad_words: list[str] | None = Omitted
    thinking_token_budget: int | None = Omitted
    repetition_detection: RepetitionDetection | None = Omitted


class RenderedPrompt(BaseModel):
    """What a prompt becomes: vLLM's render response, the token ids the engine would compute; as it is, the body of a
    ``/inference/v1/generate`` request that samples what the completion would."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling_params: RenderedSamplingParams
    priority: int = 0
    cache_salt: str | None = Omitted
    # True where the constraint applies from the first token generated (the thinking already ended, or is off).
    reasoning_ended: bool | None = Omitted


class AbortRequests(Request):
    """The ids of the requests to end (``finish_reason`` ``abort``): one, or a list."""

    request_ids: str | list[str]


class Aborted(BaseModel):
    status: Literal["aborted"] = "aborted"
    # How many of the ids named a request in flight.
    aborted: int


# What vLLM's generate request can carry and this server cannot honour: refused when set, never dropped.
UNSUPPORTED: dict[str, str] = {
    "features": "multimodal features",
    "content_parts": "multimodal content",
    "kv_transfer_params": "KV cache transfer between instances",
    "ec_transfer_params": "encoder cache transfer between instances",
}
SAMPLING_UNSUPPORTED: dict[str, str] = {
    "watermarking": "watermarking",
    "prompt_logprob_token_ids": "the logprobs of named prompt tokens",
    "prompt_logprob_start": "prompt logprobs from a position",
    "logprob_token_ids": "the logprobs of named tokens",
    "trace_decode_token_ids": "tracing decode token ids",
}


def set_extras(body: Request, names: dict[str, str]) -> list[tuple[str, str]]:
    """The extra fields of ``body`` among ``names`` sent with a value (null, false, empty and 0 are not)."""
    extras: dict[str, Any] = body.model_extra or {}
    return [(name, names[name]) for name, value in extras.items() if name in names and value not in (None, False, 0)
            and value != [] and value != {}]
