"""vLLM's ``/v1/chat/completions/batch``: N conversations in one request, each answered as ``/v1/chat/completions``
answers it, together as one chat completion whose choice ``i`` is conversation ``i``'s. As on vLLM: not streamed, no
tools, one choice per conversation."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import request_ids, responses, schemas, translate
from scheduler_svc.api.http.answering import Generating, json_response, submit_all, unless_disconnected
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.tool_schemas import CompletionTokensDetails


class BatchChatCompletionRequest(schemas.ChatCompletionRequest):
    """A chat completion request whose ``messages`` are a list of conversations."""

    messages: Annotated[list[Annotated[list[schemas.Message], Field(min_length=1)]], Field(min_length=1)]


def refuse_what_a_batch_cannot_do(body: BatchChatCompletionRequest) -> None:
    """vLLM's limits, and what one answer could not carry for several prompts."""
    for param, given, what in (
            ("stream", body.stream, "streaming"), ("tools", body.tools, "tools"),
            ("tool_choice", body.tool_choice not in (None, "none"), "a tool choice"),
            ("n", body.n not in (None, 1), "n other than 1"), ("use_beam_search", body.use_beam_search, "beam search"),
            ("prompt_logprobs", body.prompt_logprobs is not None, "prompt logprobs"),
            ("return_prompt_text", body.return_prompt_text, "the prompt's text")):
        if given:
            raise ApiError(400, f"{param}: {what} is not supported by /v1/chat/completions/batch", param)


def conversations(body: BatchChatCompletionRequest, base: str) -> list[schemas.ChatCompletionRequest]:
    """One chat completion request per conversation, the other parameters shared; named ``<base>_<i>`` as vLLM names
    them (``chatcmpl-<base>_<i>``)."""
    shared = body.model_dump(by_alias=True, exclude_unset=True, exclude={"messages"})
    return [schemas.ChatCompletionRequest.model_validate({
        **shared, "messages": [m.model_dump(by_alias=True, exclude_unset=True) for m in conversation],
        "request_id": f"{base}_{i}"}) for i, conversation in enumerate(body.messages)]


def translated(singles: list[schemas.ChatCompletionRequest], served: translate.Served,
               parsing: ChatParsing) -> list[translate.Translated]:
    """Each conversation's chat request; a refusal says which conversation it is about."""
    ts = []
    for i, single in enumerate(singles):
        try:
            ts.append(translate.chat_request(single, served, parsing))
        except ApiError as e:
            raise in_conversation(i, e) from e
    return ts


def in_conversation(i: int, error: ApiError) -> ApiError:
    return ApiError(error.status, f"conversation {i}: {error}", error.detail.param, error.detail.code)


def batch_router(source: Generating, parsing: ChatParsing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions/batch", response_model=schemas.ChatCompletion)
    async def chat_completions_batch(body: BatchChatCompletionRequest, request: Request) -> Response:
        """Every conversation's answer, choice ``i`` for conversation ``i``; the usage summed."""
        body = request_ids.named_by_header(body, request)
        refuse_what_a_batch_cannot_do(body)
        served = (await source.served())._replace(tokenizer=source.tokenizer)
        base = body.request_id or uuid.uuid4().hex
        ts = await asyncio.to_thread(translated, conversations(body, base), served, parsing)
        generations: list[list[Generation]] = []
        try:
            for i, t in enumerate(ts):
                try:
                    generations.append(await submit_all(source, t))
                except ApiError as e:
                    raise in_conversation(i, e) from e

            async def answer() -> Response:
                """Every conversation's answer; the first to fail ends the others (their requests are closed)."""
                tasks = [asyncio.ensure_future(responses.chat_completion(t, g, source.tokenizer))
                         for t, g in zip(ts, generations, strict=True)]
                try:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                finally:
                    for task in tasks:
                        task.cancel()
                for i, task in enumerate(tasks):
                    if not task.cancelled() and (error := task.exception()) is not None:
                        raise in_conversation(i, error) if isinstance(error, ApiError) else error
                return json_response(joined([task.result() for task in tasks], f"chatcmpl-{base}"))

            return await unless_disconnected(request, answer())
        finally:
            for generation in (g for gs in generations for g in gs):
                generation.close()

    return router


def joined(answers: list[schemas.ChatCompletion], response_id: str) -> schemas.ChatCompletion:
    first = answers[0]
    thinking = [a.usage.completion_tokens_details for a in answers if a.usage.completion_tokens_details]
    usage = schemas.CompletionUsage(
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=sum(
            d.reasoning_tokens for d in thinking)) if thinking else None,
        prompt_tokens=sum(a.usage.prompt_tokens for a in answers),
        completion_tokens=sum(a.usage.completion_tokens for a in answers),
        total_tokens=sum(a.usage.total_tokens for a in answers),
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=sum(
            a.usage.prompt_tokens_details.cached_tokens for a in answers if a.usage.prompt_tokens_details)))
    choices = [a.choices[0].model_copy(update={"index": i}) for i, a in enumerate(answers)]
    return schemas.ChatCompletion(id=response_id, created=first.created, model=first.model, usage=usage,
                                  choices=choices)
