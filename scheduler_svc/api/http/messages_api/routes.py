"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API as vLLM serves it, for the clients
written for it (Anthropic's SDK, Claude Code). Errors come in Anthropic's shape (``errors.ANTHROPIC_PATHS``).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import chat_render, translate
from scheduler_svc.api.http.answering import (
    Generating,
    GenerationStream,
    json_response,
    submit_all,
    unless_disconnected,
)
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.messages_api import inputs, output
from scheduler_svc.api.http.messages_api.schemas import CountTokens, CountTokensRequest, MessageObject, MessagesRequest
from scheduler_svc.api.http.openapi import STREAMED
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.errors import RequestFailed

EVENTS = {**STREAMED, 200: {**STREAMED[200], "description": "The message, or with stream its events."}}


def messages_router(source: Generating, parsing: ChatParsing) -> APIRouter:
    router = APIRouter()

    async def translated(body: MessagesRequest) -> translate.Translated:
        served = (await source.served())._replace(tokenizer=source.tokenizer)
        thinks = ThinkingMarkers.of(source.tokenizer, parsing.reasoning_parser) is not None
        chat = inputs.chat_request(body, bool(body.stream), thinks)
        try:
            if chat_render.needs_rendering(chat.messages, chat.tools) or parsing.reasoning_parser:  # off the loop
                t = await asyncio.to_thread(translate.chat_request, chat, served, parsing)
            else:
                t = translate.chat_request(chat, served, parsing)
        except ApiError as e:
            raise inputs.renamed(e) from e
        t.id = f"msg_{uuid.uuid4().hex}"
        for request in t.requests:
            request.request_id = t.id
        return t

    @router.post("/v1/messages", response_model=MessageObject, responses=EVENTS)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        t = await translated(body)
        try:
            generations: list[Generation] = await submit_all(source, t)
        except ApiError as e:
            raise inputs.renamed(e) from e
        if t.stream:
            return GenerationStream(output.events(t.id, t, generations), generations)

        async def answer() -> Response:
            message = await output.whole_message(t.id, t, generations)
            return Response(output.json_body(message.model_dump()), media_type="application/json")

        try:
            return await unless_disconnected(request, answer())
        finally:
            for generation in generations:
                generation.close()

    @router.post("/v1/messages/count_tokens", response_model=CountTokens)
    async def count_tokens(body: CountTokensRequest) -> Response:
        """The prompt's tokens, the conversation rendered as a message request would render it."""
        served = await source.served()  # in the API process, this brings the tokenizer
        translate.check_model(body.model, served)
        tokenizer = source.tokenizer
        if tokenizer is None:
            raise ApiError(400, "messages: this executor has no tokenizer to count with", "messages")
        chat = inputs.chat_request(body)
        kwargs = translate.template_kwargs(chat, parsing.default_chat_template_kwargs)
        try:
            ids = await asyncio.to_thread(
                chat_render.render, tokenizer, chat.messages, translate.message_text,
                lambda role: translate.ROLE_ALIASES.get(role, role), None, kwargs,
                [tool.template_dict() for tool in chat.tools or ()])
        except RequestFailed as e:
            raise translate.api_error(e, {}) from e
        return json_response(CountTokens(input_tokens=len(ids)))

    return router
