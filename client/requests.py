"""Builds a GenerateRequest from keyword arguments, leaving unset options to the server's defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nanoserve.v1 import generation_pb2 as pb

Message = Mapping[str, str]


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
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
) -> pb.GenerateRequest:
    """Exactly one of ``prompt`` (text), ``messages`` (chat) or ``token_ids`` must be given.

    Options left as None are not sent, so the server applies its documented defaults.
    Range checks are the server's job: it answers INVALID_ARGUMENT naming the field.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got {', '.join(given) or 'none'})")
    if isinstance(stop, str):
        stop = [stop]
    sampling = pb.SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  logprobs=logprobs)
    stopping = pb.StoppingOptions(max_tokens=max_tokens, stop=stop or [], stop_token_ids=stop_token_ids or [],
                                  ignore_eos=ignore_eos)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling, stopping=stopping,
                                 add_special_tokens=add_special_tokens)
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        request.tokens.token_ids.extend(token_ids)
    return request
