"""``/v1/responses``: create a response (whole, streamed, or in the background), retrieve a kept one (a
background stream again from any event), cancel a background one; as vLLM serves them, for models without
gpt-oss's harmony format (no built-in tools: functions only).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import translate
from scheduler_svc.api.http.answering import (
    Generating,
    GenerationStream,
    json_response,
    submit_all,
    unless_disconnected,
)
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.chat_render import needs_rendering
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.openapi import STREAMED
from scheduler_svc.api.http.responses_api import inputs, output
from scheduler_svc.api.http.responses_api.schemas import ResponseObject, ResponsesRequest
from scheduler_svc.api.http.responses_api.store import UNFINISHED, ResponseStore, Stored

log = logging.getLogger(__name__)
NO_CACHE = {"Cache-Control": "no-cache"}
FAULT = "the server failed while answering; see its log"
EVENTS = {**STREAMED, 200: {**STREAMED[200], "description": "The response, or with stream its events."}}


def shell(body: ResponsesRequest, t: translate.Translated, kept: bool) -> ResponseObject:
    """The response before its output: what the request asked, echoed."""
    return ResponseObject(
        id=t.id, created_at=t.created, status="queued" if body.background else "in_progress",
        background=bool(body.background), instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        max_tool_calls=body.max_tool_calls, metadata=body.metadata, model=t.model,
        parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
        service_tier=body.service_tier, store=kept, temperature=body.temperature,
        text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
        tool_choice="none" if not body.tools and body.tool_choice == "auto" else body.tool_choice,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools], top_logprobs=body.top_logprobs,
        top_p=body.top_p, truncation=body.truncation or "disabled", user=body.user)


def close(generations: list[Generation]) -> None:
    for generation in generations:
        generation.close()


def responses_router(source: Generating, parsing: ChatParsing) -> APIRouter:
    """The routes and the responses they keep (``--responses-store``), in the process that answers them."""
    router = APIRouter()
    store = ResponseStore(parsing.responses_store)

    async def translated(body: ResponsesRequest) -> tuple[translate.Translated, ResponseObject, Stored | None]:
        """The chat request the body amounts to, the response before its output, and its place in the store (None
        where it is not kept)."""
        history = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, "previous_response_id")
            history = previous.messages + inputs.output_messages(previous.response.output)
        served = (await source.served())._replace(tokenizer=source.tokenizer)
        conversation = inputs.conversation(body, history, parsing.auto_tool_parser, bool(body.stream))
        chat = conversation.chat
        try:
            if needs_rendering(chat.messages, chat.tools) or parsing.reasoning_parser:  # rendered off the loop
                t = await asyncio.to_thread(translate.chat_request, chat, served, parsing)
            else:
                t = translate.chat_request(chat, served, parsing)
        except ApiError as e:
            raise inputs.renamed(e) from e
        t.id = body.request_id or output.item_id("resp")
        for request in t.requests:
            request.request_id = t.id
            request.stopping.cap_max_tokens_to_room = True  # max_output_tokens past the room is the room, as on vLLM
        kept = bool(body.store) and store.enabled
        head = shell(body, t, kept)
        return t, head, Stored(head, conversation.messages) if kept else None

    async def submitted(t: translate.Translated) -> list[Generation]:
        try:
            return await submit_all(source, t)
        except ApiError as e:
            raise inputs.renamed(e) from e

    def background(entry: Stored, t: translate.Translated, generations: list[Generation]) -> Response:
        """Answered at once with the queued response; the work goes on without the client (until cancelled)."""
        working = entry.response.model_copy(update={"status": "in_progress"})

        def broke() -> None:
            """A fault of this server's, not a refusal: the response says it failed rather than work forever."""
            log.exception("background response %s failed", entry.response.id)
            entry.settle(output.failed(working, FAULT))

        async def stream() -> None:
            assert entry.events is not None
            entry.settle(working)
            try:
                async for event in output.events(working, t, generations, source.tokenizer, entry.settle):
                    entry.add(event)
            except Exception:
                broke()
                entry.add(output.sse_event("error", len(entry.events), code="server_error", message=FAULT, param=None))

        async def whole() -> None:
            entry.settle(working)
            try:
                entry.settle(await output.whole_response(working, t, generations, source.tokenizer))
            except ApiError as e:
                entry.settle(output.failed(working, str(e)))
            except Exception:
                broke()

        def ended(task: asyncio.Task) -> None:
            """However the work ends (done, failed, cancelled even before it began), its requests are closed."""
            close(generations)
            entry.end()

        store.put(entry)
        if t.stream:
            entry.events = []
        entry.task = asyncio.create_task(stream() if t.stream else whole())
        entry.task.add_done_callback(ended)
        if t.stream:
            return StreamingResponse(entry.replay(None), media_type="text/event-stream", headers=NO_CACHE)
        return json_response(entry.response)

    @router.post("/v1/responses", response_model=ResponseObject, responses=EVENTS)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        if body.background and (not body.store or not store.enabled):
            why = "needs store true" if store.enabled else "needs a server that keeps responses (--responses-store N)"
            raise ApiError(400, f"background: {why}", "background")
        t, head, entry = await translated(body)
        generations = await submitted(t)

        def done(final: ResponseObject) -> None:
            if entry is not None:
                entry.settle(final)
                store.put(entry)

        if entry is not None and body.background:
            return background(entry, t, generations)
        if t.stream:
            return GenerationStream(output.events(head, t, generations, source.tokenizer, done), generations)

        async def answer() -> Response:
            try:
                final = await output.whole_response(head, t, generations, source.tokenizer)
            except ApiError as e:
                done(output.failed(head, str(e)))  # kept as failed, as a stream's failure is
                raise
            done(final)
            return json_response(final)

        try:
            return await unless_disconnected(request, answer())
        finally:
            close(generations)

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=EVENTS)
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        """A kept response; with ``stream``, a background stream's events after ``starting_after``."""
        entry = store.get(response_id, "response_id")
        if not stream:
            return json_response(entry.response)
        if entry.events is None:
            raise ApiError(400, "stream: only a response created with background and stream true streams again",
                           "stream")
        return StreamingResponse(entry.replay(starting_after), media_type="text/event-stream", headers=NO_CACHE)

    @router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
    async def cancel_response(response_id: str) -> Response:
        entry = store.get(response_id, "response_id")
        if entry.task is None:
            raise ApiError(400, "response_id: Cannot cancel a synchronous response.", "response_id")
        if entry.response.status not in UNFINISHED:
            raise ApiError(400, f"response_id: the response is already {entry.response.status}", "response_id")
        entry.response = entry.response.model_copy(update={"status": "cancelled"})
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
        return json_response(entry.response)

    return router

