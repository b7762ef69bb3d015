"""A public GenerateRequest turned into what the engine runs: prompt token ids and SamplingParams.

Everything a caller can get wrong is checked here, before the request reaches
the engine loop, and refused with InvalidRequest naming the proto field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from nanoserve.v1 import executor_pb2
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.sampling import InvalidRequest, SamplingParams
from scheduler_svc.tokenizer import ChatMessage, ModelTokenizer

DEFAULT_MAX_TOKENS = 256

# Engine and SamplingParams field names -> the GenerateRequest field a caller sets.
PROTO_FIELD = {
    "token_ids": "tokens.token_ids",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "logprobs": "sampling.logprobs",
    "max_tokens": "stopping.max_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
}


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: ModelTokenizer | None, vocab_size: int) -> list[int]:
    """The prompt as token ids, whichever form it came in."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "no prompt set; send text, chat or tokens")
    if kind == "tokens":
        token_ids = list(request.tokens.token_ids)
        if not token_ids:
            raise InvalidRequest("tokens.token_ids", "the prompt is empty")
        for i, t in enumerate(token_ids):
            if t >= vocab_size:
                raise InvalidRequest(
                    "tokens.token_ids", f"token id {t} at position {i} is outside the vocabulary [0, {vocab_size})"
                )
        return token_ids
    if tokenizer is None:
        raise InvalidRequest(kind, "this executor has no tokenizer; send the prompt as tokens")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "the prompt is empty")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
    else:
        chat = request.chat
        messages = [ChatMessage(m.role, m.content) for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        token_ids = tokenizer.encode_chat(messages, add_generation_prompt)
    if not token_ids:
        raise InvalidRequest(kind, "the prompt encodes to no tokens")
    return token_ids


def max_tokens(stopping: pb.StoppingOptions, num_prompt_tokens: int, max_model_len: int) -> int:
    """The requested completion budget, or the default capped to the room the prompt leaves."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(
            "prompt",
            f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate within the model's "
            f"maximum length of {max_model_len} tokens",
        )
    if not stopping.HasField("max_tokens"):
        return min(DEFAULT_MAX_TOKENS, room)
    requested = stopping.max_tokens
    if requested < 1:
        raise InvalidRequest("stopping.max_tokens", f"must be >= 1, got {requested}")
    if requested > room:
        raise InvalidRequest(
            "stopping.max_tokens",
            f"prompt of {num_prompt_tokens} tokens + max_tokens {requested} = {num_prompt_tokens + requested} "
            f"exceeds the model's maximum length of {max_model_len} tokens",
        )
    return requested


def sampling_params(
    request: pb.GenerateRequest, num_prompt_tokens: int, max_model_len: int, has_tokenizer: bool
) -> SamplingParams:
    s, stopping = request.sampling, request.stopping
    if stopping.stop and not has_tokenizer:
        raise InvalidRequest("stopping.stop", "stop strings need a tokenizer and this executor has none")
    budget = max_tokens(stopping, num_prompt_tokens, max_model_len)
    try:
        return SamplingParams(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            min_p=s.min_p,
            seed=s.seed if s.HasField("seed") else None,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            max_tokens=budget,
            ignore_eos=stopping.ignore_eos,
            stop=list(stopping.stop),
            stop_token_ids=list(stopping.stop_token_ids),
        )
    except InvalidRequest as e:
        raise public_error(e) from e


def public_error(error: InvalidRequest) -> InvalidRequest:
    """The same refusal, naming the field as a caller spells it in GenerateRequest."""
    return InvalidRequest(PROTO_FIELD.get(error.field, error.field), str(error).removeprefix(f"{error.field}: "))


def prepare(
    request: pb.GenerateRequest, info: executor_pb2.ExecutorInfo, tokenizer: ModelTokenizer | None
) -> PreparedRequest:
    """Validate and translate ``request``; raise InvalidRequest naming the first bad field."""
    token_ids = prompt_token_ids(request, tokenizer, info.vocab_size)
    params = sampling_params(request, len(token_ids), info.max_model_len, tokenizer is not None)
    request_id = request.request_id or uuid.uuid4().hex
    return PreparedRequest(request_id, token_ids, params)
