"""The engine loop's outputs out, as OpenAI's objects: whole completions, or server-sent-event chunks.

Choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response, as OpenAI numbers a list of
prompts. Usage counts each prompt once (the loop puts it on choice 0) and every choice's completion.
A failure after the stream has started is sent as an ``{"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel

from common.step import TokenLogprobs
from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.tool_schemas import CompletionTokensDetails
from scheduler_svc.api.http.translate import Translated, api_error
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.outputs import RequestOutput, RequestUsage
from scheduler_svc.core.tokenizer import ModelTokenizer

DONE = "data: [DONE]\n\n"


def sse(message: BaseModel) -> str:
    return f"data: {message.model_dump_json()}\n\n"


@dataclass
class Piece:
    """A run of outputs of one choice, joined; the last one decides the finish."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's stop_reason: the stop string or stop token id that ended a STOP.
    stop_reason: str | int | None = None
    usage: RequestUsage | None = None
    # The prompt's token ids and the logprobs of the second on, on a first piece when the request asked.
    prompt: tuple[list[int], list[TokenLogprobs]] | None = None

    def add(self, output: RequestOutput) -> None:
        self.join(output.text, output.token_ids, output.logprobs, output.prompt_logprobs)
        if output.finish_reason is not None:
            self.finish_reason, self.usage = output.finish_reason.value, output.usage
            self.stop_reason = output.matched_stop

    def join(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs],
             prompt: tuple[list[int], list[TokenLogprobs]] | None) -> None:
        self.text += text
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.prompt = self.prompt or prompt


class UsageTotal:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, usage: RequestUsage | None) -> None:
        if usage is not None:
            self.prompt += usage.prompt_tokens
            self.completion += usage.completion_tokens
            self.cached += usage.cached_prompt_tokens

    def usage(self) -> schemas.CompletionUsage:
        return schemas.CompletionUsage(prompt_tokens=self.prompt, completion_tokens=self.completion,
                             total_tokens=self.prompt + self.completion,
                             prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=self.cached))


async def merged(generations: list[Generation]) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
    """Every generation's batches as they come, labelled with the generation's position. One prompt (every chat
    request) reads its generation directly: waiting on a task per batch costs the event loop time on every token."""
    if len(generations) == 1:
        async for batch in generations[0].batches():
            yield 0, batch
        return
    iterators = [generation.batches() for generation in generations]

    async def next_batch(i: int) -> list[RequestOutput] | None:
        return await anext(iterators[i], None)

    pending = {asyncio.ensure_future(next_batch(i)): i for i in range(len(iterators))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                batch = future.result()
                if batch is not None:
                    pending[asyncio.ensure_future(next_batch(i))] = i
                    yield i, batch
    finally:
        for future in pending:
            future.cancel()


async def pieces(t: Translated, generations: list[Generation]) -> AsyncIterator[Piece]:
    """One piece per run of outputs of the same choice, numbered across prompts."""
    async for position, outputs in merged(generations):
        for index, run in itertools.groupby(outputs, key=lambda output: output.index):
            piece = Piece(position * t.n + index)
            for output in run:
                piece.add(output)
            if t.echo_only:  # the prompt alone: what was generated is not shown
                piece.text, piece.token_ids, piece.logprobs = "", [], []
            yield piece


def token_text(tokenizer: ModelTokenizer | None, token_id: int) -> str:
    """A token as text; vLLM's ``token_id:N`` where the executor brought no tokenizer."""
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"token_id:{token_id}"


# JSON has no -inf (a token a grammar bans): vLLM sends this in its place, a float every client can read.
LOWEST_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def alternatives(lp: TokenLogprobs, top: int) -> Iterable[tuple[int, float]]:
    return zip(lp.top_token_ids[:top], map(finite, lp.top_logprobs[:top]), strict=True)


def chat_logprobs(piece: Piece, t: Translated, tokenizer: ModelTokenizer | None) -> schemas.ChatLogprobs | None:
    if t.top_logprobs is None:
        return None
    named_by = None if t.tokens_as_ids else tokenizer  # token_id:<id>, as asked

    def entry(token_id: int, logprob: float, sampled: bool = False) -> schemas.TopLogprob:
        """As vLLM's: a sampled token named by id keeps its own text's bytes; an alternative, its name's."""
        text = token_text(named_by, token_id)
        own = token_text(tokenizer, token_id) if sampled else text
        return schemas.TopLogprob(token=text, logprob=finite(logprob), bytes=list(own.encode()))

    content = []
    for token_id, lp in zip(piece.token_ids, piece.logprobs, strict=False):
        top = [entry(t_id, p) for t_id, p in alternatives(lp, t.top_logprobs)]
        content.append(schemas.TokenLogprob(**entry(token_id, lp.logprob, True).model_dump(), top_logprobs=top))
    return schemas.ChatLogprobs(content=content)


def completion_logprobs(piece: Piece, t: Translated, tokenizer: ModelTokenizer | None,
                        offset: int) -> schemas.CompletionLogprobs | None:
    """``offset``: where the piece starts in the choice's text, for ``text_offset``."""
    if t.top_logprobs is None:
        return None
    out = schemas.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    add_legacy_logprobs(out, zip(piece.token_ids, piece.logprobs, strict=False), t, tokenizer, offset)
    return out


def add_legacy_logprobs(out: schemas.CompletionLogprobs, tokens: Iterable[tuple[int, TokenLogprobs | None]],
                        t: Translated, tokenizer: ModelTokenizer | None, offset: int) -> None:
    """Each (token id, its logprobs: None for none) into OpenAI's legacy shape, ``text_offset`` from ``offset``."""
    tokenizer = None if t.tokens_as_ids else tokenizer  # token_id:<id>, as asked
    for token_id, lp in tokens:
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else finite(lp.logprob))
        out.top_logprobs.append(None if lp is None else {token_text(tokenizer, t_id): p
                                                         for t_id, p in alternatives(lp, t.top_logprobs)})
        out.text_offset.append(offset)
        offset += len(text)


def prompt_logprobs(prompt: tuple[list[int], list[TokenLogprobs]] | None, tokenizer: ModelTokenizer | None
                    ) -> schemas.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a scored prompt: none for its first token, then each token's logprob and its
    alternatives', by token id."""
    if prompt is None:
        return None
    out: schemas.PromptLogprobs = [None]
    for token_id, lp in zip(prompt[0][1:], prompt[1], strict=True):
        ranked = {t_id: schemas.PromptLogprob(logprob=finite(p), rank=rank, decoded_token=token_text(tokenizer, t_id))
                  for rank, (t_id, p) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1)}
        own = ranked.get(token_id) or schemas.PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                            decoded_token=token_text(tokenizer, token_id))
        out.append({token_id: own, **ranked})
    return out


def echoed_logprobs(prompt: tuple[list[int], list[TokenLogprobs]], t: Translated, tokenizer: ModelTokenizer | None,
                    after: schemas.CompletionLogprobs) -> schemas.CompletionLogprobs:
    """``after`` (the completion's) behind the echoed prompt's tokens, as vLLM answers ``echo`` with ``logprobs``:
    the first prompt token has none, offsets count from the prompt's start."""
    token_ids, logprobs = prompt
    out = schemas.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    add_legacy_logprobs(out, zip(token_ids, [None, *logprobs], strict=True), t, tokenizer, 0)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(after, name))
    return out


async def whole(t: Translated, generations: list[Generation]) -> tuple[list[Piece], schemas.CompletionUsage]:
    """Every choice joined, in order, and the usage; raises the request's failure as an answer."""
    choices = [Piece(i) for i in range(len(generations) * t.n)]
    usage = UsageTotal()
    try:
        async for piece in pieces(t, generations):
            choice = choices[piece.index]
            choice.join(piece.text, piece.token_ids, piece.logprobs, piece.prompt)
            choice.finish_reason, choice.stop_reason = piece.finish_reason, piece.stop_reason
            usage.add(piece.usage)
    except RequestFailed as e:
        raise api_error(e, t.renames) from e
    return [c for c in choices if c.finish_reason is not None], usage.usage()  # a beam search may answer fewer


def token_ids(piece: Piece, t: Translated) -> list[int] | None:
    return piece.token_ids if t.return_token_ids else None


async def chat_completion(t: Translated, generations: list[Generation],
                          tokenizer: ModelTokenizer | None) -> schemas.ChatCompletion:
    choices, usage = await whole(t, generations)
    output = t.chat_output
    hidden = output is not None and output.hides_tokens
    counters = [output.reasoning_tokens(tokenizer) for _ in choices] if output is not None else []
    if counters and counters[0] is not None:  # --reasoning-parser: the thinking's tokens, as vLLM counts them
        usage.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=sum(counter.add(c.token_ids) for counter, c in zip(counters, choices, strict=True)))
    return schemas.ChatCompletion(id=t.id, created=t.created, model=t.model, usage=usage,
                                  prompt_logprobs=prompt_logprobs(choices[0].prompt, tokenizer),
                                  **chat_prompt(t, generations[0], tokenizer), choices=[
        schemas.ChatChoice(index=c.index, message=message, logprobs=None if hidden else chat_logprobs(c, t, tokenizer),
                           finish_reason=finish_reason, stop_reason=c.stop_reason,
                           token_ids=None if hidden else token_ids(c, t))
        for c in choices for message, finish_reason in [chat_message(c, t)]])


def chat_prompt(t: Translated, generation: Generation, tokenizer: ModelTokenizer | None) -> dict[str, object]:
    """vLLM's ``prompt_token_ids`` (``return_token_ids``) and ``prompt_text`` (``return_prompt_text``) of a chat
    answer, where asked."""
    ids = generation.prompt_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=False) if t.return_prompt_text and ids and tokenizer else None
    return {"prompt_token_ids": ids if t.return_token_ids else None, "prompt_text": text}


def chat_message(choice: Piece, t: Translated) -> tuple[schemas.AssistantMessage, str | None]:
    """A whole choice's message (its thinking and tool calls read out of its text, when the request or the server
    asks) and its finish reason."""
    output, echo = t.chat_output, t.echo[0] if t.echo else ""  # vLLM's echo: before the content, as read
    if output is None or not output.active:
        return schemas.AssistantMessage(content=echo + choice.text), choice.finish_reason
    parsed = output.reader().whole(choice.text)
    message = schemas.AssistantMessage(content=echo + (parsed.content or "") if echo else parsed.content,
                                       tool_calls=output.one_call(parsed.calls) or None, reasoning=parsed.reasoning)
    return message, output.finish_reason(choice.finish_reason, bool(parsed.calls), streamed=False)


async def completion(t: Translated, generations: list[Generation],
                     tokenizer: ModelTokenizer | None) -> schemas.TextCompletion:
    choices, usage = await whole(t, generations)
    out, by_index = [], {c.index: c for c in choices}
    for c in choices:
        echo = t.echo[c.index // t.n] if t.echo else ""
        logprobs = completion_logprobs(c, t, tokenizer, len(echo))
        prompt = by_index[c.index - c.index % t.n].prompt  # only a prompt's first choice scores it
        if t.echo and logprobs is not None and prompt is not None:
            logprobs = echoed_logprobs(prompt, t, tokenizer, logprobs)
        out.append(schemas.CompletionChoice(index=c.index, text=echo + c.text, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, logprobs=logprobs, token_ids=token_ids(c, t),
                                            prompt_logprobs=prompt_logprobs(prompt, tokenizer),
                                            prompt_token_ids=generations[c.index // t.n].prompt_token_ids))
    return schemas.TextCompletion(id=t.id, created=t.created, model=t.model, choices=out, usage=usage)


async def streamed(t: Translated, generations: list[Generation], first: Iterable[BaseModel],
                   chunk_of: Callable[[Piece], BaseModel | None],
                   last: Callable[[schemas.CompletionUsage], BaseModel],
                   details: Callable[[int], CompletionTokensDetails | None] = lambda index: None) -> AsyncIterator[str]:
    """The SSE framing both endpoints share: ``first`` chunks, one chunk per piece (none where ``chunk_of`` has
    nothing to send), the usage, ``[DONE]``. With vLLM's continuous usage each chunk carries its choice's usage so
    far (and its ``details``)."""
    completed = [0] * (len(generations) * t.n)  # each choice's completion tokens so far

    def with_usage(message: BaseModel, index: int) -> BaseModel:
        if t.continuous_usage:
            prompt = generations[index // t.n].num_prompt_tokens
            message.usage = schemas.CompletionUsage(prompt_tokens=prompt, completion_tokens=completed[index],
                                                    total_tokens=prompt + completed[index],
                                                    completion_tokens_details=details(index))
        return message

    for message in first:
        yield sse(with_usage(message, message.choices[0].index))
    usage = UsageTotal()
    try:
        async for piece in pieces(t, generations):
            usage.add(piece.usage)
            if t.continuous_usage:
                completed[piece.index] = piece.usage.completion_tokens if piece.usage else (
                    completed[piece.index] + len(piece.token_ids))
            if (message := chunk_of(piece)) is not None:
                yield sse(with_usage(message, piece.index))
        if t.include_usage:
            yield sse(last(usage.usage()))
    except RequestFailed as e:
        yield sse(api_error(e, t.renames).body())
    yield DONE


def chat_chunks(t: Translated, generations: list[Generation], tokenizer: ModelTokenizer | None) -> AsyncIterator[str]:
    """Each choice's role first, then its content as it is decoded (and its tool calls as they are read, when the
    request or the server asks: ``chat_output``)."""
    output = t.chat_output if t.chat_output is not None and t.chat_output.active else None
    readers = [output.reader() for _ in range(len(generations) * t.n)] if output is not None else []
    # With --reasoning-parser, each choice's thinking tokens so far (for the usage).
    counters = [output.reasoning_tokens(tokenizer) for _ in readers] if output is not None else []
    counting = bool(counters) and counters[0] is not None
    hidden = output is not None and output.hides_tokens

    def chunk(choices: list[schemas.ChatChunkChoice], usage: schemas.CompletionUsage | None = None,
              **prompt: object) -> BaseModel:
        return schemas.ChatCompletionChunk(id=t.id, created=t.created, model=t.model, choices=choices, usage=usage,
                                           **prompt)

    def chunk_of(piece: Piece) -> BaseModel | None:
        logprobs, ids, finish_reason = chat_logprobs(piece, t, tokenizer), token_ids(piece, t), piece.finish_reason
        if counting:
            counters[piece.index].add(piece.token_ids)
        if hidden:
            logprobs = ids = None
        if output is None:
            delta = schemas.Delta(content=piece.text) if piece.text or finish_reason is None else schemas.Delta()
        else:
            reader = readers[piece.index]
            parts = reader.delta(piece.text, finished=finish_reason is not None)
            if parts is None and finish_reason is None and logprobs is None and ids is None:
                return None
            delta = schemas.Delta() if parts is None else schemas.Delta(
                content=parts.content, reasoning=parts.reasoning, tool_calls=output.one_call(parts.calls) or None)
            if finish_reason is not None:
                finish_reason = output.finish_reason(finish_reason, reader.called, streamed=True)
        return chunk([schemas.ChatChunkChoice(index=piece.index, delta=delta, finish_reason=finish_reason,
                                              stop_reason=piece.stop_reason, logprobs=logprobs, token_ids=ids)])

    def details(index: int | None) -> CompletionTokensDetails | None:
        """The thinking tokens of a choice so far (None: of all), where the server has a reasoning parser."""
        if not counting:
            return None
        return CompletionTokensDetails(reasoning_tokens=sum(
            counter.count for i, counter in enumerate(counters) if index is None or i == index))

    def last(usage: schemas.CompletionUsage) -> BaseModel:
        usage.completion_tokens_details = details(None)
        return chunk([], usage)

    # Each choice's role; with vLLM's echo, then the assistant's final message its answer goes on from.
    # As vLLM's: each choice's role chunk carries the prompt's token ids (return_token_ids), the first its text.
    prompt = chat_prompt(t, generations[0], tokenizer)
    roles = (chunk([schemas.ChatChunkChoice(index=i, delta=schemas.Delta(**fields))],
                   prompt_token_ids=prompt["prompt_token_ids"] if "role" in fields else None,
                   prompt_text=prompt["prompt_text"] if "role" in fields and i == 0 else None)
             for i in range(len(generations) * t.n)
             for fields in [{"role": "assistant", "content": ""}, *([{"content": t.echo[0]}] if t.echo else [])])
    return streamed(t, generations, roles, chunk_of, last, details)


def completion_chunks(t: Translated, generations: list[Generation],
                      tokenizer: ModelTokenizer | None) -> AsyncIterator[str]:
    """``text_completion`` chunks; with ``echo`` each choice's prompt comes first (with ``logprobs``, theirs on the
    choice's first tokens: they come with them)."""
    offsets = [len(t.echo[i // t.n]) if t.echo else 0 for i in range(len(generations) * t.n)]
    prompts: dict[int, tuple[list[int], list[TokenLogprobs]]] = {}  # by prompt, from its first choice
    unscored = set(range(len(offsets))) if t.echo and t.top_logprobs is not None else set()

    def chunk(choices: list[schemas.CompletionChoice], usage: schemas.CompletionUsage | None = None) -> BaseModel:
        return schemas.TextCompletion(id=t.id, created=t.created, model=t.model, choices=choices, usage=usage)

    def chunk_of(piece: Piece) -> BaseModel:
        logprobs = completion_logprobs(piece, t, tokenizer, offsets[piece.index])
        offsets[piece.index] += len(piece.text)
        if piece.prompt is not None:
            prompts[piece.index // t.n] = piece.prompt
        if piece.index in unscored and logprobs is not None and (prompt := prompts.get(piece.index // t.n)):
            unscored.discard(piece.index)
            logprobs = echoed_logprobs(prompt, t, tokenizer, logprobs)
        prompt_ids = None if t.echo or piece.index in started else generations[piece.index // t.n].prompt_token_ids
        started.add(piece.index)
        return chunk([schemas.CompletionChoice(index=piece.index, text=piece.text, logprobs=logprobs,
                                               finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
                                               token_ids=token_ids(piece, t), prompt_token_ids=prompt_ids)])

    # With return_token_ids (vLLM's), each choice's first chunk carries its prompt's token ids: the echo's, if any.
    started: set[int] = set()
    echoes = (chunk([schemas.CompletionChoice(index=i, text=t.echo[i // t.n],
                                              prompt_token_ids=generations[i // t.n].prompt_token_ids)])
              for i in range(len(offsets)) if t.echo)
    return streamed(t, generations, echoes, chunk_of, lambda usage: chunk([], usage))
