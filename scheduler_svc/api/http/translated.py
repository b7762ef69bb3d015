"""An OpenAI request as translated (``translate``): the GenerateRequests it becomes, and how to answer it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.beam_search import BeamSettings
from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.chat_output import ChatOutput
from scheduler_svc.api.http.errors import ApiError


@dataclass
class Translated:
    """An OpenAI request as the GenerateRequests it becomes (one per prompt), and how to answer it."""

    id: str
    model: str
    requests: list[pb.GenerateRequest]
    # GenerateRequest field (prefix-free, see ``openai_param``) -> the OpenAI parameter that set it.
    renames: dict[str, str]
    n: int
    stream: bool
    include_usage: bool
    # Alternatives per token when logprobs were asked for, else None.
    top_logprobs: int | None
    return_token_ids: bool
    # Per request: the text its choices start with (``echo``); empty when not asked.
    echo: list[str]
    # vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far.
    continuous_usage: bool = False
    # echo with max_tokens 0: the choices are their prompts alone (the token generated is left out).
    echo_only: bool = False
    # How a chat request's choices are read (thinking, tool calls); None for completions.
    chat_output: ChatOutput | None = None
    # vLLM's return_prompt_text (chat): the prompt's text comes back, its token ids decoded.
    return_prompt_text: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name their tokens token_id:<id>.
    tokens_as_ids: bool = False
    # vLLM's use_beam_search: the search's settings (its choices are its beams); None: sampled as asked.
    beam: BeamSettings | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def shown_logprobs(body: schemas.GenerationParameters, asked: int | None, needs: str) -> int | None:
    """The alternatives an answer's logprobs show per token: ``asked``; with vLLM's logprob_token_ids, which need
    logprobs asked for (``needs`` says how), each of those tokens (and an echoed prompt's ``asked``)."""
    named = len(set(body.logprob_token_ids or ()))
    if not named:
        return asked
    if asked is None:
        raise ApiError(400, f"logprob_token_ids: needs {needs}", "logprob_token_ids")
    return max(named, asked)
