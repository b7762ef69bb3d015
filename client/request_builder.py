"""Builds a GenerateRequest from keyword arguments, leaving unset options to the server's defaults."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TypeVar

from common.sampling import TO_MODEL_LENGTH
from nanoserve.v1 import generation_pb2 as pb

M = TypeVar("M")

Message = Mapping[str, str]


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    max_tokens_to_room: bool | None = None,
    cap_max_tokens_to_room: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool | None = None,
    logprobs: int | None = None,
    request_id: str | None = None,
    add_special_tokens: bool | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    n: int | None = None,
    min_tokens: int | None = None,
    include_stop_str_in_output: bool | None = None,
    skip_special_tokens: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: str | None = None,
    prompt_logprobs: int | None = None,
    json_schema: str | Mapping | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool | None = None,
    grammar_from_first_token: bool | None = None,
    stream_interval: int | None = None,
    lora: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] | str | None = None,
    priority: int | None = None,
    return_prompt_token_ids: bool | None = None,
    cache_salt: str | None = None,
    thinking_token_budget: int | None = None,
    logprob_token_ids: Sequence[int] | None = None,
    repetition_detection: Mapping[str, int] | None = None,
) -> pb.GenerateRequest:
    """Exactly one of ``prompt`` (text), ``messages`` (chat) or ``token_ids`` must be given, and at most one
    structured-output constraint (``json_schema`` as JSON text or a dict, ``regex``, ``choice``, ``grammar``
    in Lark or GBNF, ``json_object``); ``grammar_from_first_token``: with one, it applies from the first token even
    where the server's ``--reasoning-parser`` would have it wait for the thinking's end. ``lora``: the LoRA adapter
    to run through, by name (None: the base model).
    ``chat_template_kwargs``: more variables for the chat template with ``messages`` (vLLM's option).
    ``max_tokens_to_room``: without ``max_tokens``, generate up to the room the prompt leaves (vLLM's chat default).
    ``cap_max_tokens_to_room``: a ``max_tokens`` beyond that room is the room, not a refusal (vLLM's Responses API).
    ``allowed_token_ids``: only these may be sampled (an empty list is sent, and refused, as vLLM refuses it);
    ``bad_words``: words the completion must not produce, tokenized by the server as vLLM tokenizes them.
    ``priority``: lower is admitted first and preempted last, where the scheduler runs ``--request-order priority``.
    ``return_prompt_token_ids``: the prompt's token ids as the model reads them come back (vLLM's return_token_ids).
    ``cache_salt``: the prompt hits only prefix-cache blocks computed for requests of the same salt (vLLM's).
    ``thinking_token_budget``: the most tokens the model may think before ``</think>`` is forced (vLLM's; the server
    needs ``--reasoning-parser``); -1 is none, as vLLM reads it. ``logprob_token_ids``: each token's logprobs list
    these tokens' as its alternatives, in this order, instead of the most likely (vLLM's; ``logprobs`` may be left
    out). ``repetition_detection``: vLLM's ``{"max_pattern_size", "min_pattern_size", "min_count"}``, the completion
    ending (finish reason "repetition") once its last tokens repeat such a pattern.

    Options left as None are not sent, so the server applies its documented defaults; ``top_k`` -1 disables it, as
    in vLLM (0 in the proto), and ``truncate_prompt_tokens`` -1 keeps the model's length less one, as vLLM's;
    ``truncation_side`` "right" keeps the prompt's first tokens instead of its last ("left"), as vLLM's.
    Range checks are the server's job (INVALID_ARGUMENT naming the field), but for values the proto's types cannot
    hold (a negative count): ValueError naming the option.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got {', '.join(given) or 'none'})")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(bad_words, str):
        bad_words = [bad_words]
    allowed = None if allowed_token_ids is None else token_id_list("allowed_token_ids", allowed_token_ids)
    sampling = message(pb.SamplingOptions, temperature=temperature, top_k=0 if top_k == -1 else top_k, top_p=top_p,
                       min_p=min_p, seed=seed, logprobs=logprobs, repetition_penalty=repetition_penalty,
                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       logit_bias=logit_bias or {}, n=n, allowed_token_ids=allowed, bad_words=bad_words or [],
                       thinking_token_budget=None if thinking_token_budget == -1 else thinking_token_budget,
                       logprob_token_ids=logprob_token_ids or [])
    stopping = message(pb.StoppingOptions, max_tokens=max_tokens, stop=stop or [], stop_token_ids=stop_token_ids or [],
                       ignore_eos=ignore_eos, min_tokens=min_tokens,
                       include_stop_str_in_output=include_stop_str_in_output, max_tokens_to_room=max_tokens_to_room,
                       cap_max_tokens_to_room=cap_max_tokens_to_room,
                       repetition_detection=pb.RepetitionDetection(**repetition_detection) if repetition_detection
                       else None)
    if truncate_prompt_tokens == -1:
        truncate_prompt_tokens = TO_MODEL_LENGTH  # the server knows the model's length
    if truncation_side not in (None, "left", "right"):
        raise ValueError(f"truncation_side: 'left' or 'right', got {truncation_side!r}")
    request = message(pb.GenerateRequest, request_id=request_id, sampling=sampling, stopping=stopping,
                      add_special_tokens=add_special_tokens, skip_special_tokens=skip_special_tokens,
                      truncate_prompt_tokens=truncate_prompt_tokens, prompt_logprobs=prompt_logprobs,
                      stream_interval=stream_interval, lora=lora, priority=priority,
                      return_prompt_token_ids=return_prompt_token_ids, cache_salt=cache_salt,
                      truncation_side=pb.TRUNCATION_SIDE_RIGHT if truncation_side == "right" else None)
    constraint = structured_output(json_schema, regex, choice, grammar, json_object)
    if constraint is not None:
        request.structured_output.CopyFrom(constraint)
        request.structured_output.from_first_token = bool(grammar_from_first_token)
    elif grammar_from_first_token is not None:
        raise ValueError("grammar_from_first_token: needs a structured-output constraint")
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.CopyFrom(chat_prompt(messages, chat_template_kwargs))
    else:
        request.tokens.token_ids.extend(token_ids)
    return request


def chat_prompt(messages: Sequence[Message], template_kwargs: Mapping[str, object] | None = None) -> pb.ChatPrompt:
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    if template_kwargs:
        chat.template_kwargs.update(template_kwargs)
    return chat


def token_id_list(name: str, token_ids: Sequence[int]) -> pb.TokenIdList:
    """A ``TokenIdList``, even empty (a message, so the server tells it from one not given); ValueError naming
    ``name`` for an id the proto cannot hold."""
    try:
        return pb.TokenIdList(token_ids=list(token_ids))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: {e}") from None


def message(cls: type[M], **fields: object) -> M:
    """``cls(**fields)``; a value its field's type cannot hold raises ValueError naming the field."""
    try:
        return cls(**fields)
    except (ValueError, TypeError):
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{name}: {e}") from None
        raise


def structured_output(json_schema: str | Mapping | None, regex: str | None, choice: Sequence[str] | None,
                      grammar: str | None, json_object: bool | None) -> pb.StructuredOutput | None:
    """The one constraint given, or None; several are refused here, since the proto holds one."""
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                                             ("grammar", grammar), ("json_object", json_object))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one structured-output constraint (got {', '.join(given)})")
    if not given:
        return None
    (name, value), = given.items()
    if name == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if name == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(value)))
    return pb.StructuredOutput(**{name: value})


def tokenize_request(text: str | None = None, messages: Sequence[Message] | None = None,
                     add_special_tokens: bool | None = None,
                     chat_template_kwargs: Mapping[str, object] | None = None) -> pb.TokenizeRequest:
    """Exactly one of ``text`` or ``messages`` (rendered with the model's chat template)."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    request = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(chat_prompt(messages, chat_template_kwargs))
    return request
