"""vLLM's request ids over HTTP: a request's ``X-Request-Id`` header names it (``chatcmpl-<id>``, ``cmpl-<id>``,
``generate-tokens-<id>``) in place of the body's ``request_id``, so a caller or a gateway that traces it can abort
it by that name; with --enable-request-id-headers every answer carries the header back (the request's own, or a new
one)."""

from __future__ import annotations

import uuid
from typing import TypeVar

from fastapi import FastAPI, Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_svc.api.http.schemas import GenerationParameters

HEADER = "X-Request-Id"
Body = TypeVar("Body", bound=GenerationParameters)


def named_by_header(body: Body, request: Request) -> Body:
    """``body`` with ``request``'s header id as its ``request_id`` (vLLM's rule: the header wins)."""
    header = request.headers.get(HEADER)
    return body if header is None else body.model_copy(update={"request_id": header})


class RequestIdHeaders:
    """Every HTTP answer carries ``X-Request-Id``: the request's, else a new random one (as vLLM's middleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


def install(app: FastAPI, enabled: bool) -> None:
    """Inside CORS (installed after this), outside the API key's check, so that a 401 carries it too."""
    if enabled:
        app.add_middleware(RequestIdHeaders)
