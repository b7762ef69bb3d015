"""``/inference/v1/generate`` (answered where the completion routes are: in the API process when there is one) and
``/inference/v1/abort_requests`` (in the scheduler, which ends the requests named; their streams end with
``finish_reason`` abort)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from scheduler_svc.api.frontend import Frontend
from scheduler_svc.api.http import request_ids
from scheduler_svc.api.http.answering import (
    Generating,
    GenerationStream,
    json_response,
    submit_all,
    unless_disconnected,
)
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.generate_api import inputs, output
from scheduler_svc.api.http.generate_api.schemas import Aborted, AbortRequests, GenerateRequest, GenerateResponse
from scheduler_svc.api.http.openapi import STREAMED


def generate_router(source: Generating, parsing: ChatParsing) -> APIRouter:
    """``parsing``: the server's flags (its --return-tokens-as-token-ids names text mode's logprob tokens)."""
    router = APIRouter()

    @router.post("/inference/v1/generate", response_model=GenerateResponse, responses=STREAMED)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """Token ids in, the sampled token ids out (with ``output_mode`` text, their text too)."""
        t = inputs.generate_request(body, await source.served(), request.headers.get(request_ids.HEADER),
                                    source.stream_interval)
        text_mode = body.output_mode == "text"
        t.tokens_as_ids = parsing.return_tokens_as_token_ids
        if text_mode and source.tokenizer is None:
            raise ApiError(400, "output_mode: text needs the model's tokenizer, which this executor did not bring; "
                                "send output_mode tokens", "output_mode")
        generations = await submit_all(source, t)
        if t.stream:
            return GenerationStream(output.chunks(t, generations, source.tokenizer, text_mode), generations)

        async def answer() -> Response:
            return json_response(await output.whole(t, generations, source.tokenizer, text_mode))

        try:
            return await unless_disconnected(request, answer())
        finally:
            for generation in generations:
                generation.close()

    return router


def abort_router(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.post("/inference/v1/abort_requests", response_model=Aborted)
    async def abort_requests(body: AbortRequests) -> Response:
        """Ends each request named (by the id it was sent with, or the answer's ``generate-tokens-`` one) with
        ``finish_reason`` abort; its KV blocks are free before the next step. Ids not in flight are skipped."""
        found = frontend.abort(inputs.with_prefix(body.request_ids))
        return json_response(Aborted(aborted=len(found)))

    return router
