"""Public requests in: a GenerateRequest (or a Tokenize / Detokenize one) checked and turned into plain objects.

Every refusal names the GenerateRequest field a caller sets (``PROTO_FIELD``); the checks themselves are
``scheduler_svc.core.validation``'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace

from google.protobuf import json_format

from common.sampling import TO_MODEL_LENGTH
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.structured import compile_grammar
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.bad_words import bad_words_token_ids
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from scheduler_svc.core.validation import (
    ModelLimits,
    check_at_least_one,
    check_cache_salt,
    check_fits_cache,
    check_prompt,
    check_resume,
    check_sampling,
    check_token_ids,
    completion_budget,
)

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
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "logit_bias": "sampling.logit_bias",
    "n": "sampling.n",
    "min_tokens": "stopping.min_tokens",
    "allowed_token_ids": "sampling.allowed_token_ids",
    "bad_words": "sampling.bad_words",
    "thinking_token_budget": "sampling.thinking_token_budget",
    "logprob_token_ids": "sampling.logprob_token_ids",
    "repetition_detection": "stopping.repetition_detection",
}
# Fields of the GenerateRequest itself that SamplingParams holds.
OPTIONAL_REQUEST = ("skip_special_tokens", "prompt_logprobs")

def public_error(error: InvalidRequest) -> InvalidRequest:
    """The same refusal, naming the field as a caller spells it in GenerateRequest."""
    return InvalidRequest(PROTO_FIELD.get(error.field, error.field), error.reason)


def truncated(token_ids: list[int], request: pb.GenerateRequest, max_model_len: int) -> list[int]:
    """The last ``truncate_prompt_tokens`` of the prompt, when asked (vLLM's option of that name), or its first with
    ``truncation_side`` right; ``TO_MODEL_LENGTH``: as many as leave an answer one token, as vLLM's -1."""
    if not request.HasField("truncate_prompt_tokens"):
        return token_ids
    keep = request.truncate_prompt_tokens
    check_at_least_one("truncate_prompt_tokens", keep)
    keep = max(1, max_model_len - 1) if keep == TO_MODEL_LENGTH else keep
    return token_ids[:keep] if request.truncation_side == pb.TRUNCATION_SIDE_RIGHT else token_ids[-keep:]


def stream_interval(request: pb.GenerateRequest) -> int | None:
    """The request's own stream interval, when it sets one."""
    if not request.HasField("stream_interval"):
        return None
    check_at_least_one("stream_interval", request.stream_interval)
    return request.stream_interval


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: ModelTokenizer | None) -> list[int]:
    """The prompt as token ids, whichever form it came in (checked against the model later)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "no prompt set; send text, chat or tokens")
    if kind == "tokens":
        return list(request.tokens.token_ids)
    if tokenizer is None:
        raise InvalidRequest(kind, "this executor has no tokenizer; send the prompt as tokens")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "the prompt is empty")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
    else:
        token_ids = chat_token_ids(request.chat, tokenizer)
    if not token_ids:
        raise InvalidRequest(kind, "the prompt encodes to no tokens")
    return token_ids


# Fields whose absence means their default (proto3 optional), as SamplingParams names them.
OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "n", "thinking_token_budget")
OPTIONAL_STOPPING = ("ignore_eos", "min_tokens", "include_stop_str_in_output")


def tokenize(request: pb.TokenizeRequest, tokenizer: ModelTokenizer | None) -> list[int]:
    """The Tokenize RPC: the ids Generate would see for this text or conversation (empty text is fine here)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "nothing to tokenize; send text or chat")
    if tokenizer is None:
        raise InvalidRequest(kind, "this executor has no tokenizer")
    if kind == "text":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return tokenizer.encode(request.text, add_special_tokens=add_special)
    return chat_token_ids(request.chat, tokenizer)


def chat_token_ids(chat: pb.ChatPrompt, tokenizer: ModelTokenizer) -> list[int]:
    """The conversation rendered with the model's chat template, as token ids."""
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else (
        not chat.continue_final_message)
    if add_generation_prompt and chat.continue_final_message:  # as vLLM refuses it
        raise InvalidRequest("chat.continue_final_message", "not with add_generation_prompt true: a final message is "
                                                            "continued, or a new one begun")
    template_kwargs = json_format.MessageToDict(chat.template_kwargs) if chat.HasField("template_kwargs") else None
    return tokenizer.encode_chat([ChatMessage(m.role, m.content) for m in chat.messages], add_generation_prompt,
                                 template_kwargs, chat.continue_final_message)


def detokenize(request: pb.DetokenizeRequest, tokenizer: ModelTokenizer | None, vocab_size: int) -> str:
    if tokenizer is None:
        raise InvalidRequest("token_ids", "this executor has no tokenizer")
    bad = next((i for i, t in enumerate(request.token_ids) if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("token_ids", f"token id {request.token_ids[bad]} at position {bad} is outside the "
                                          f"vocabulary [0, {vocab_size})")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)


def sampling_params(request: pb.GenerateRequest, budget: int, grammar: str | None = None,
                    model_defaults: Mapping[str, object] | None = None,
                    tokenizer: ModelTokenizer | None = None) -> SamplingParams:
    """Unset fields take the model's defaults (``model_defaults``: generation_config.json's, by field), else
    ``sampling.DEFAULTS`` (SamplingParams' own defaults). ``tokenizer`` turns the bad words into token ids."""
    s, stopping = request.sampling, request.stopping
    given = {name: value for name, value in (model_defaults or {}).items() if name != "max_tokens"}
    given.update((name, getattr(s, name)) for name in OPTIONAL_SAMPLING if s.HasField(name))
    given.update((name, getattr(stopping, name)) for name in OPTIONAL_STOPPING if stopping.HasField(name))
    given.update((name, getattr(request, name)) for name in OPTIONAL_REQUEST if request.HasField(name))
    if s.HasField("allowed_token_ids"):  # a message, so that a list given empty is refused, as vLLM refuses it
        given["allowed_token_ids"] = list(s.allowed_token_ids.token_ids)
    return SamplingParams(max_tokens=budget, stop=list(stopping.stop), stop_token_ids=stopping.stop_token_ids,
                          logit_bias=dict(s.logit_bias), grammar=grammar,
                          logprob_token_ids=tuple(s.logprob_token_ids),
                          repetition_detection=repetition_detection(stopping),
                          bad_words_token_ids=bad_words_token_ids(s.bad_words, tokenizer), **given)


def repetition_detection(stopping: pb.StoppingOptions) -> tuple[int, int, int] | None:
    """vLLM's repetition_detection as (min_pattern_size, max_pattern_size, min_count), refused as vLLM refuses it;
    None where off (max_pattern_size 0)."""
    if not stopping.HasField("repetition_detection"):
        return None
    given = stopping.repetition_detection
    if given.min_pattern_size > given.max_pattern_size:
        raise InvalidRequest("repetition_detection", f"min_pattern_size ({given.min_pattern_size}) must be at most "
                                                     f"max_pattern_size ({given.max_pattern_size})")
    return (given.min_pattern_size or 1, given.max_pattern_size, given.min_count) if given.max_pattern_size else None


def thinking_off(request: pb.GenerateRequest) -> bool:
    """Whether a chat prompt's template kwargs turn the thinking off (``enable_thinking``: false)."""
    chat = request.chat if request.WhichOneof("prompt") == "chat" else None
    value = chat.template_kwargs.fields.get("enable_thinking") if chat is not None else None
    return value is not None and value.WhichOneof("kind") == "bool_value" and not value.bool_value


def thinking_markers(thinking: ThinkingMarkers | None) -> tuple[int, int]:
    """The markers a thinking budget counts from and forces; InvalidRequest where the scheduler reads none."""
    if thinking is None:
        raise InvalidRequest("thinking_token_budget", "needs the scheduler's --reasoning-parser, and a vocabulary "
                                                      "with <think> and </think>")
    return thinking.start, thinking.end


def prepare(request: pb.GenerateRequest, limits: ModelLimits, tokenizer: ModelTokenizer | None,
            model_defaults: Mapping[str, object] | None = None,
            thinking: ThinkingMarkers | None = None) -> PreparedRequest:
    """Validate and translate ``request``; raise InvalidRequest naming the first bad GenerateRequest field.
    ``model_defaults``: the model's request defaults (``GenerationDefaults.given()``), for the fields it leaves
    unset; max_tokens only where ``stopping.max_tokens`` is unset (an HTTP completion always sets it).
    ``thinking``: the markers of ``--reasoning-parser``, whose thinking a grammar waits for (``api.thinking``)."""
    try:
        check_cache_salt(request.cache_salt)
        token_ids = truncated(prompt_token_ids(request, tokenizer), request, limits.max_model_len)
        check_prompt(token_ids, limits)
        if request.stopping.stop and tokenizer is None:
            raise InvalidRequest("stop", "stop strings need a tokenizer and this executor has none")
        requested = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else None
        grammar = compile_grammar(request.structured_output, tokenizer, limits.vocab_size)
        budget = completion_budget(requested, len(token_ids), limits, request.stopping.max_tokens_to_room,
                                   (model_defaults or {}).get("max_tokens"), request.stopping.cap_max_tokens_to_room)
        params = sampling_params(request, budget, grammar, model_defaults, tokenizer)
        if grammar is not None and thinking is not None and thinking.waits(
                token_ids, request.structured_output.from_first_token, thinking_off(request)):
            params = replace(params, grammar_after_token_ids=(thinking.end,))
        if params.thinking_token_budget is not None:
            params = replace(params, thinking_markers=thinking_markers(thinking))
        check_sampling(params)
        check_token_ids(params, limits)
        resumed = list(request.resume.completion_token_ids)
        check_resume(resumed, params, limits)
        check_fits_cache(len(token_ids), params, limits)
        interval = stream_interval(request)
    except InvalidRequest as e:
        raise public_error(e) from e
    return PreparedRequest(request.request_id or uuid.uuid4().hex, token_ids, params, resumed, interval, request.lora,
                           request.priority, request.return_prompt_token_ids, request.cache_salt)
