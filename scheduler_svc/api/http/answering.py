"""How the generation routes hand their requests to the engine and their answers to the client: the requests of one
answer submitted together (``submit_all``), a whole answer abandoned when its client goes away
(``unless_disconnected``), a streamed one closing its generations however it ends (``GenerationStream``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.beam_search import BeamSearchGeneration
from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import translate
from scheduler_svc.core.beam_search import BeamStart
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer

# Sent instead of a response nobody is left to read.
CLIENT_CLOSED = 499


class Generating(Protocol):
    """Where the generation routes send their requests: the scheduler's ``Frontend`` (``FrontendGenerating``), or
    the API process's link (``api.api_http``), which writes the streams out of the scheduler's process."""

    @property
    def tokenizer(self) -> ModelTokenizer | None: ...

    @property
    def stream_interval(self) -> int:
        """The server's --stream-interval: tokens a streamed choice gathers before a chunk carries them."""
        ...

    async def served(self) -> translate.Served: ...

    async def submit(self, request: pb.GenerateRequest, whole: bool) -> Generation: ...

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart:
        """What a beam search makes of ``request`` before its first step (``api.beam_search``)."""
        ...

    async def submit_step(self, request: pb.GenerateRequest) -> Generation:
        """A beam search's step, read whole: ended at once where its id was aborted while the last step was held."""
        ...


def json_response(message: BaseModel) -> Response:
    return Response(message.model_dump_json(), media_type="application/json")


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is already read, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, or, if the client goes away first, ``work`` cancelled."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else Response(status_code=CLIENT_CLOSED)


class GenerationStream(StreamingResponse):
    """Server-sent events that close their generations however the response ends: finished, cancelled by a
    client gone mid-stream, or before it even started."""

    def __init__(self, chunks: AsyncIterator[str], generations: list[Generation]) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.close()


def raise_stream_interval(t: translate.Translated, asked: int | None, server: int) -> None:
    """vLLM's per-request ``stream_interval``: it may raise the server's --stream-interval for the request's streamed
    chunks, never lower it."""
    if asked is not None:
        for request in t.requests:
            request.stream_interval = max(asked, server)


async def submit_all(source: Generating, t: translate.Translated) -> list[Generation]:
    """Every prompt's request, or none: one refused closes those already queued."""
    generations: list[Generation] = []
    try:
        for request in t.requests:
            generations.append(await source.submit(request, not t.stream))
    except BaseException as e:
        for generation in generations:
            generation.close()
        if isinstance(e, RequestFailed):
            raise translate.api_error(e, t.renames) from e
        raise
    return generations


async def beam_searches(source: Generating, t: translate.Translated) -> list[BeamSearchGeneration]:
    """Each prompt's beam search (``t.beam``), checked before any runs: they run as their answer reads them."""
    try:
        return [await BeamSearchGeneration.begin(source, request, t.beam, source.tokenizer) for request in t.requests]
    except RequestFailed as e:
        raise translate.api_error(e, t.renames) from e
