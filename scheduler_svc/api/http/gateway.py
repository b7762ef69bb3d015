"""What gateways ask a worker over HTTP besides completions: who it is (``/version``, which the Shepherd Model Gateway
probes to tell vLLM-compatible engines from generic ones, and ``/server_info``) and what a prompt becomes
(vLLM's render routes, which llm-d's precise prefix-cache scorer reads token ids from).

A render request is translated and checked exactly as its completion request would be (``Frontend.render``):
the same refusals, the same token ids, nothing queued.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.frontend import Frontend
from scheduler_svc.api.http import request_ids, schemas, translate
from scheduler_svc.api.http.chat_output import NO_PARSING, ChatParsing
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.generate_api.schemas import RenderedPrompt, RenderedSamplingParams
from scheduler_svc.api.server_info import ServerInfo, engine_version
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.request import PreparedRequest

# /server_info's body: the shared dataclass as JSON.
SERVER_INFO = TypeAdapter(ServerInfo)


def json_response(message: schemas.BaseModel | list[RenderedPrompt]) -> Response:
    if isinstance(message, list):
        body = "[" + ",".join(item.model_dump_json() for item in message) + "]"
    else:
        body = message.model_dump_json()
    return Response(body, media_type="application/json")


def structured_outputs(request: pb.GenerateRequest) -> dict[str, object] | None:
    """The request's constraint as vLLM's ``structured_outputs``, which ``/inference/v1/generate`` takes back."""
    kind = request.structured_output.WhichOneof("kind") if request.HasField("structured_output") else None
    if kind is None or (kind == "json_object" and not request.structured_output.json_object):
        return None
    if kind == "choice":
        return {"choice": list(request.structured_output.choice.choices)}
    if kind == "json_schema":
        return {"json": json.loads(request.structured_output.json_schema)}
    return {kind: getattr(request.structured_output, kind)}


def rendered(prepared: PreparedRequest, request: pb.GenerateRequest, model: str) -> RenderedPrompt:
    p = prepared.params
    sampling = RenderedSamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, stop=p.stop, stop_token_ids=sorted(p.stop_token_ids),
        ignore_eos=p.ignore_eos, include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, structured_output=p.grammar is not None,
        structured_outputs=structured_outputs(request), bad_words=list(request.sampling.bad_words) or None,
        thinking_token_budget=p.thinking_token_budget,
        repetition_detection=None if p.repetition_detection is None else schemas.RepetitionDetection(
            min_pattern_size=p.repetition_detection[0], max_pattern_size=p.repetition_detection[1],
            min_count=p.repetition_detection[2]),
        allowed_token_ids=(list(request.sampling.allowed_token_ids.token_ids)
                           if request.sampling.HasField("allowed_token_ids") else None))
    return RenderedPrompt(request_id=prepared.request_id, model=model, token_ids=prepared.prompt_token_ids,
                          sampling_params=sampling, priority=request.priority, cache_salt=request.cache_salt or None,
                          reasoning_ended=request.structured_output.from_first_token or None)


def gateway_router(frontend: Frontend, served_model: Callable[[], translate.Served],
                   parsing: ChatParsing = NO_PARSING) -> APIRouter:
    """``served_model``: what a request's ``model`` may name now (the OpenAI routes' own)."""
    router = APIRouter()

    async def render(t: translate.Translated) -> list[RenderedPrompt]:
        """Refused where ``/inference/v1/generate`` would not do what the completion would."""
        for param, given in (("use_beam_search", t.beam is not None),
                             ("logprob_token_ids", any(r.sampling.logprob_token_ids for r in t.requests))):
            if given:
                raise ApiError(400, f"{param}: /inference/v1/generate does not take it, so it is not rendered", param)
        prompts = []
        for request in t.requests:
            try:
                prepared = await frontend.render(request)
            except RequestFailed as e:
                raise translate.api_error(e, t.renames) from e
            prompts.append(rendered(prepared, request, t.model))
        return prompts

    @router.get("/version", response_model=schemas.Version)
    async def version() -> Response:
        return json_response(schemas.Version(version=engine_version()))

    @router.get("/server_info", response_model=ServerInfo)
    async def server_info() -> Response:
        return Response(SERVER_INFO.dump_json(frontend.server_info()), media_type="application/json")

    @router.post("/v1/completions/render", response_model=list[RenderedPrompt])
    async def completions_render(body: schemas.CompletionRenderRequest, request: Request) -> Response:
        """The token ids of each prompt, one object per prompt, as ``/v1/completions`` would compute them."""
        body = request_ids.named_by_header(body, request)
        return json_response(await render(translate.completion_request(body, served_model(), frontend.tokenizer)))

    @router.post("/v1/chat/completions/render", response_model=RenderedPrompt)
    async def chat_completions_render(body: schemas.ChatCompletionRenderRequest, request: Request) -> Response:
        """The conversation rendered with the chat template, as ``/v1/chat/completions`` would compute it."""
        body = request_ids.named_by_header(body, request)
        (prompt,) = await render(translate.chat_request(body, served_model(), parsing))
        return json_response(prompt)

    return router
