"""The OpenAI HTTP API in the API process: the completion routes answered from the link, every other route passed on.

At hundreds of streams the SSE chunks of the completion routes cost the process that writes them a core (W5 over
HTTP, docs/benchmarks-history.md); in the scheduler's process that core is the engine loop's, which an accelerator
waits for. Here ``/v1/completions`` and ``/v1/chat/completions`` are translated and answered by the scheduler's own
code (``http.app.generation_router``), their requests sent over the link as the gRPC streams' are; what a request's
``model`` may name and the tokenizer come from the scheduler (the ``served`` question). Every other route (models,
tokenize, LoRA, health, metrics, the gateways' probes, the OpenAPI document) is passed to the scheduler's HTTP app on
a Unix socket in the private folder (``Forwarder``), which answers as it does without this process.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.http import request_ids, translate
from scheduler_svc.api.http.app import ApiKeyMiddleware, answer_failures, generation_router
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.cors import Cors
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.load import track_load
from scheduler_svc.api.outbox import ChoicesReader
from scheduler_svc.core.beam_search import BeamStart
from scheduler_svc.core.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    from scheduler_svc.api.api_process import Call, Link

# Headers that describe one connection, not the message: never passed on (RFC 9110, section 7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class LinkGeneration(ChoicesReader):
    """One request sent over the link, read as the routes read a ``frontend.Generation``."""

    def __init__(self, link: Link, key: int, call: Call, n: int, num_prompt_tokens: int,
                 prompt_token_ids: list[int] | None) -> None:
        super().__init__(call.outbox, n)
        self._link, self._key = link, key
        self.num_prompt_tokens = num_prompt_tokens
        # Where the request asked for them (``return_prompt_token_ids``), else None.
        self.prompt_token_ids = prompt_token_ids

    def close(self) -> None:
        """A request not finished (its caller went away, or it failed) is cancelled in the scheduler."""
        self._link.close(self._key, cancel=bool(self.remaining))


class LinkGenerating:
    """``http.answering.Generating`` over the link (event-loop thread only)."""

    def __init__(self, link: Link, stream_interval: int) -> None:
        self._link = link
        self.stream_interval = stream_interval
        self.tokenizer: ModelTokenizer | None = None
        self._has_tokenizer = False
        self._tokenizer_lock = asyncio.Lock()

    async def served(self) -> translate.Served:
        """Asked per request: adapters come and go through the routes passed on. The first answer after the
        executor's handshake brings its tokenizer (the same for every executor the scheduler accepts after it);
        requests that come while it is built wait for it, so none is answered without it."""
        if self._has_tokenizer:
            names, adapters, _ = await self._link.ask("served", False)
            return translate.Served.of(names, adapters)
        async with self._tokenizer_lock:
            first = not self._has_tokenizer
            names, adapters, tokenizer = await self._link.ask("served", first)
            if first:
                self.tokenizer = await asyncio.to_thread(ModelTokenizer, *tokenizer) if tokenizer is not None else None
                self._has_tokenizer = True
        return translate.Served.of(names, adapters)

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart:
        (start,) = await self._link.ask("beam_start", request.SerializeToString())
        return start

    async def submit(self, request: pb.GenerateRequest, whole: bool) -> LinkGeneration:
        interval = math.inf if whole else request.stream_interval or self.stream_interval
        _, generation = await self._link.start("submit", request.SerializeToString(), interval, whole)
        return generation

    async def submit_step(self, request: pb.GenerateRequest) -> LinkGeneration:
        _, generation = await self._link.start("submit_step", request.SerializeToString(), math.inf, True)
        return generation


class Forwarder:
    """Passes a request on to the scheduler's HTTP app on its Unix socket, and its answer back as it comes."""

    def __init__(self, socket_path: str) -> None:
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                        base_url="http://scheduler", timeout=None)

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/{path:path}", self.forward, methods=METHODS, include_in_schema=False)
        return router

    async def forward(self, request: Request) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        query = request.scope["query_string"]
        url = self.client.base_url.copy_with(raw_path=request.scope["raw_path"] + (b"?" + query if query else b""))
        upstream = self.client.build_request(request.method, url, headers=headers, content=await request.body())
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.TransportError as e:
            raise ApiError(503, f"the scheduler did not answer: {e}") from e

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        answer = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in HOP_BY_HOP - {"content-length"}]
        streamed = StreamingResponse(body(), status_code=response.status_code)
        streamed.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer]
        return streamed

    async def close(self) -> None:
        await self.client.aclose()


def create_api_app(source: LinkGenerating, forwarder: Forwarder, api_key: str, cors: Cors,
                   parsing: ChatParsing, load_tracking: bool = False, request_id_headers: bool = False) -> FastAPI:
    """The public HTTP app of the API process. The OpenAPI document and its page are the scheduler's (passed on)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    answer_failures(app)
    app.include_router(generation_router(source, parsing))
    track_load(app, load_tracking)  # counted where the generation routes are answered: here
    app.include_router(forwarder.router())
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    request_ids.install(app, request_id_headers)  # here, not also on the scheduler's app it passes requests to
    cors.install(app)
    return app
