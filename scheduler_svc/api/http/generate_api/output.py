"""The engine's outputs as vLLM's generate answers: one object, or a stream of one choice's new tokens per event.

Logprobs list the candidates as vLLM's engine keeps them: the sampled token first, then the others by rank, as many
as asked (at least one). A sampled token outside the candidates has the rank the executor counted (the tokens at least
as likely, itself included, as vLLM counts it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

from common.step import TokenLogprobs
from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import responses, schemas
from scheduler_svc.api.http.generate_api.schemas import (
    GenerateChoice,
    GenerateChunk,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateResponse,
)
from scheduler_svc.api.http.responses import DONE, Piece, UsageTotal, finite, pieces, sse, token_text
from scheduler_svc.api.http.translate import Translated, api_error
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer


def candidates(token_id: int, lp: TokenLogprobs, asked: int) -> list[GenerateLogProb]:
    """The sampled token, then the ``asked`` most likely others, cut to ``asked`` (at least one) as vLLM cuts them."""
    ranked = list(zip(lp.top_token_ids[:asked], lp.top_logprobs[:asked], strict=True))
    rank_of = {t_id: rank for rank, (t_id, _) in enumerate(ranked, 1)}
    out = [GenerateLogProb(token_id=token_id, logprob=finite(lp.logprob), rank=rank_of.get(token_id, lp.rank))]
    out += [GenerateLogProb(token_id=t_id, logprob=finite(p), rank=rank)
            for rank, (t_id, p) in enumerate(ranked, 1) if t_id != token_id]
    return out[:max(asked, 1)]


def token_logprobs(piece: Piece, asked: int) -> GenerateLogProbs:
    content = []
    for token_id, lp in zip(piece.token_ids, piece.logprobs, strict=False):
        top = candidates(token_id, lp, asked)
        content.append(GenerateLogProbsContent(**top[0].model_dump(), top_logprobs=top))
    return GenerateLogProbs(content=content)


def text_logprobs(piece: Piece, asked: int, named_by: ModelTokenizer | None) -> schemas.ChatLogprobs:
    """``named_by``: what names the tokens (None: ``token_id:<id>``, as --return-tokens-as-token-ids asks)."""
    def entry(candidate: GenerateLogProb) -> schemas.TopLogprob:
        text = token_text(named_by, candidate.token_id)
        return schemas.TopLogprob(token=text, logprob=candidate.logprob, bytes=list(text.encode()))

    content = []
    for token_id, lp in zip(piece.token_ids, piece.logprobs, strict=False):
        top = [entry(c) for c in candidates(token_id, lp, asked)]
        content.append(schemas.TokenLogprob(**top[0].model_dump(), top_logprobs=top))
    return schemas.ChatLogprobs(content=content)


def choice(piece: Piece, t: Translated, tokenizer: ModelTokenizer | None, text_mode: bool,
           finish: str | None) -> GenerateChoice:
    logprobs: GenerateLogProbs | schemas.ChatLogprobs | None = None
    if t.top_logprobs is not None:
        logprobs = (text_logprobs(piece, t.top_logprobs, None if t.tokens_as_ids else tokenizer) if text_mode
                    else token_logprobs(piece, t.top_logprobs))
    return GenerateChoice(index=piece.index, finish_reason=finish, stop_reason=piece.stop_reason,
                          token_ids=piece.token_ids, text=piece.text if text_mode else None, logprobs=logprobs)


def mode(text_mode: bool) -> Literal["tokens", "text"]:
    return "text" if text_mode else "tokens"


async def whole(t: Translated, generations: list[Generation], tokenizer: ModelTokenizer | None,
                text_mode: bool) -> GenerateResponse:
    """Every choice joined; a choice that ended without a reason (none does) reads as vLLM's default, stop."""
    choices, usage = await responses.whole(t, generations)
    return GenerateResponse(
        request_id=t.id, model=t.model, created=t.created, output_mode=mode(text_mode), usage=usage,
        choices=[choice(c, t, tokenizer, text_mode, c.finish_reason or "stop") for c in choices],
        prompt_logprobs=responses.prompt_logprobs(choices[0].prompt, tokenizer),
        prompt_token_ids=generations[0].prompt_token_ids)


async def chunks(t: Translated, generations: list[Generation], tokenizer: ModelTokenizer | None,
                 text_mode: bool) -> AsyncIterator[str]:
    """One event per run of a choice's outputs that brings tokens, text or its finish; the prompt's token ids on the
    first (where asked); with ``include_usage`` a last event of the usage alone; then ``[DONE]``."""
    (generation,) = generations
    prompt_ids, prompt_tokens = generation.prompt_token_ids, generation.num_prompt_tokens
    completed = [0] * t.n
    usage = UsageTotal()
    try:
        async for piece in pieces(t, generations):
            usage.add(piece.usage)
            completed[piece.index] = (piece.usage.completion_tokens if piece.usage
                                      else completed[piece.index] + len(piece.token_ids))
            if not (piece.token_ids or piece.finish_reason or (text_mode and piece.text)):
                continue
            chunk = GenerateChunk(request_id=t.id, output_mode=mode(text_mode),
                                  choices=[choice(piece, t, tokenizer, text_mode, piece.finish_reason)])
            if prompt_ids is not None:
                chunk.prompt_token_ids, prompt_ids = prompt_ids, None
            if t.continuous_usage:
                chunk.usage = schemas.CompletionUsage(prompt_tokens=prompt_tokens,
                                                      completion_tokens=completed[piece.index],
                                                      total_tokens=prompt_tokens + completed[piece.index])
            yield sse(chunk)
        if t.include_usage:
            yield sse(GenerateChunk(request_id=t.id, output_mode=mode(text_mode), choices=[], usage=usage.usage()))
    except RequestFailed as e:
        yield sse(api_error(e, t.renames).body())
    yield DONE
