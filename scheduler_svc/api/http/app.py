"""The OpenAI-compatible routes: each translates its body to the GenerateRequests the gRPC API receives, sends
them through the same ``Frontend``, and translates the outputs back; no engine logic lives here.

A streamed response whose client goes away is cancelled by Starlette (``GenerationStream``), and a whole
response's by ``unless_disconnected``; either way its generations close, which cancels their requests, so their KV
blocks are free before the next step. ``/metrics`` is Prometheus' (``metrics_router``), open like ``/health`` and
every route outside ``GUARDED_PREFIXES``; ``create_metrics_app`` serves it alone on --metrics-port.
``/openapi.json`` and ``/docs`` describe every route (``openapi``); ``gateway`` adds what gateways probe
(``/version``, ``/server_info``, the render routes).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from common.executor import LoraRefused
from common.security import bearer_token
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.frontend import Frontend, Generation
from scheduler_svc.api.http import request_ids, responses, schemas, translate
from scheduler_svc.api.http.admin import recording_router
from scheduler_svc.api.http.answering import (
    Generating,
    GenerationStream,
    beam_searches,
    json_response,
    raise_stream_interval,
    submit_all,
    unless_disconnected,
)
from scheduler_svc.api.http.chat_batch import batch_router
from scheduler_svc.api.http.chat_output import NO_PARSING, ChatParsing
from scheduler_svc.api.http.chat_render import needs_rendering
from scheduler_svc.api.http.cors import ANY_ORIGIN, Cors
from scheduler_svc.api.http.dev import DEV_ROUTES, dev_router
from scheduler_svc.api.http.errors import ANTHROPIC_PATHS, ApiError, install_handlers
from scheduler_svc.api.http.gateway import gateway_router
from scheduler_svc.api.http.generate_api.routes import abort_router, generate_router
from scheduler_svc.api.http.load import track_load
from scheduler_svc.api.http.messages_api.routes import messages_router
from scheduler_svc.api.http.openapi import ERRORS, STREAMED, without_validation_errors
from scheduler_svc.api.http.responses_api.routes import responses_router
from scheduler_svc.api.recording import RecordingControl
from scheduler_svc.api.server_info import engine_version
from scheduler_svc.core.beam_search import BeamStart
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer

# What the API key guards, by path prefix: vLLM's --api-key guards exactly its API prefixes (the first four) and
# leaves the rest open (/health, /metrics, /version, /server_info, /tokenize, ...), which probes, scrapers and
# gateways call without a key (the Shepherd Model Gateway tells a vLLM worker by /version); "/admin" is nanoserve's
# own, which no vLLM route matches: the recording's switch writes to the disk. SageMaker's /invocations stays open,
# as on vLLM: SageMaker calls it without a key, having authorized the caller itself. The dev mode's routes, which
# vLLM leaves unguarded, are guarded here: they stop serving or cost every later request its cache hits.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/admin", *DEV_ROUTES)
# ``responses``' two ways to answer: SSE chunks, or one whole object.
Chunks = Callable[[translate.Translated, list[Generation], ModelTokenizer | None], AsyncIterator[str]]
Whole = Callable[[translate.Translated, list[Generation], ModelTokenizer | None], Awaitable[BaseModel]]


class ApiKeyMiddleware:
    """Answer 401 before anything else (the body is not even read) unless ``Authorization: Bearer <key>`` (or, for
    Anthropic's Messages API, its ``x-api-key: <key>``), on a guarded path; a CORS preflight (OPTIONS) never, as
    vLLM's, since a browser sends it without the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if (scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS"
                and path.startswith(GUARDED_PREFIXES)):
            headers = tuple((k.decode("latin-1"), v) for k, v in scope["headers"])
            token = bearer_token(headers)
            if token is None and path.startswith(ANTHROPIC_PATHS):  # Anthropic's own header, as its SDK sends it
                token = next((value for key, value in headers if key == "x-api-key"), None)
            if token is None or not hmac.compare_digest(token, self.api_key):
                message = "this server needs an API key: send the header 'Authorization: Bearer <key>'"
                await ApiError(401, message).answer_path(path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def served_by(frontend: Frontend) -> Callable[[], translate.Served]:
    """What a request's ``model`` may name now: the base model (by any served name) or a LoRA adapter loaded then;
    with the tokenizer, which renders a conversation with tools."""
    return lambda: translate.Served.of(frontend.model_names(), frozenset(a.name for a in frontend.adapters()),
                                       frontend.tokenizer)


class FrontendGenerating:
    """``Generating`` in the scheduler's own process."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._served = served_by(frontend)

    @property
    def tokenizer(self) -> ModelTokenizer | None:
        return self.frontend.tokenizer

    @property
    def stream_interval(self) -> int:
        return self.frontend.stream_interval

    async def served(self) -> translate.Served:
        return self._served()

    async def submit(self, request: pb.GenerateRequest, whole: bool) -> Generation:
        return await self.frontend.submit(request, whole)

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart:
        return await self.frontend.beam_start(request)

    async def submit_step(self, request: pb.GenerateRequest) -> Generation:
        return await self.frontend.submit(request, True, continued=True)


def generation_router(source: Generating, parsing: ChatParsing) -> APIRouter:
    """``/v1/chat/completions`` and ``/v1/completions``, answered from ``source``; chat answers read with the
    scheduler's flags (``parsing``)."""
    router = APIRouter()

    async def generate(request: Request, body: schemas.GenerationParameters, t: translate.Translated, chunks: Chunks,
                       whole: Whole) -> Response:
        raise_stream_interval(t, body.stream_interval, source.stream_interval)
        if t.stream and parsing.force_include_usage:  # --enable-force-include-usage: every chunk's, as vLLM's
            t.include_usage = t.continuous_usage = True
        generations = await (beam_searches(source, t) if t.beam is not None else submit_all(source, t))
        if t.stream:
            return GenerationStream(chunks(t, generations, source.tokenizer), generations)

        async def answer() -> Response:
            return json_response(await whole(t, generations, source.tokenizer))

        try:
            return await unless_disconnected(request, answer())
        finally:
            for generation in generations:
                generation.close()

    @router.post("/v1/chat/completions", response_model=schemas.ChatCompletion, responses=STREAMED)
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        body = request_ids.named_by_header(body, request)
        served = (await source.served())._replace(tokenizer=source.tokenizer)
        if needs_rendering(body.messages, body.tools) or parsing.reasoning_parser:  # rendered here: off the loop
            t = await asyncio.to_thread(translate.chat_request, body, served, parsing)
        else:
            t = translate.chat_request(body, served, parsing)
        return await generate(request, body, t, responses.chat_chunks, responses.chat_completion)

    @router.post("/v1/completions", response_model=schemas.TextCompletion, responses=STREAMED)
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        body = request_ids.named_by_header(body, request)
        t = translate.completion_request(body, await source.served(), source.tokenizer, parsing)
        return await generate(request, body, t, responses.completion_chunks, responses.completion)

    @router.post("/invocations", response_model=schemas.ChatCompletion | schemas.TextCompletion, responses=STREAMED)
    async def invocations(request: Request) -> Response:
        """SageMaker's one route, which vLLM serves: a chat completion for a body with ``messages``, else a
        completion (``prompt``)."""
        try:
            body = await request.json()
        except ValueError as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict) or not ({"messages", "prompt"} & body.keys()):
            raise ApiError(400, "messages: send messages (a chat completion) or prompt (a completion)", "messages")
        kind = schemas.ChatCompletionRequest if "messages" in body else schemas.CompletionRequest
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        if isinstance(parsed, schemas.ChatCompletionRequest):
            return await chat_completions(parsed, request)
        return await completions(parsed, request)

    router.include_router(responses_router(source, parsing))
    router.include_router(messages_router(source, parsing))
    router.include_router(generate_router(source, parsing))
    router.include_router(batch_router(source, parsing))
    return router


def routes(frontend: Frontend, serving: Callable[[], bool], parsing: ChatParsing = NO_PARSING) -> APIRouter:
    router = APIRouter()
    started = int(time.time())
    served_model = served_by(frontend)

    def model_cards() -> list[schemas.ModelCard]:
        """As vLLM's: the base model under each served name (its root the executor's model id), then each LoRA
        adapter, its parent the first served name."""
        info, names = frontend.ready().info, frontend.model_names()
        base = [schemas.ModelCard(id=name, created=started, root=info.model_id, max_model_len=info.max_model_len)
                for name in names]
        return [*base, *(schemas.ModelCard(id=a.name, created=started, root=a.path, parent=names[0],
                                           max_model_len=info.max_model_len) for a in frontend.adapters())]

    @router.get("/v1/models", response_model=schemas.ModelList)
    async def models() -> Response:
        return json_response(schemas.ModelList(data=model_cards()))

    @router.get("/v1/models/{model:path}", response_model=schemas.ModelCard)
    async def model(model: str) -> Response:
        translate.check_model(model, served_model())  # 404 unless a card has this id
        return json_response(next(card for card in model_cards() if card.id == model))

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: schemas.LoadLoraAdapterRequest) -> Response:
        """Refused unless the executor runs with --runtime-lora."""
        try:
            await frontend.load_lora(body.lora_name, body.lora_path, body.load_inplace)
        except LoraRefused as e:
            raise lora_error(e) from e
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: schemas.UnloadLoraAdapterRequest) -> Response:
        """New requests naming the adapter are refused at once; those through it already run to their end."""
        try:
            await frontend.unload_lora(body.lora_name)
        except LoraRefused as e:
            raise lora_error(e) from e
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @router.get("/health")
    async def health() -> Response:
        """200 exactly when gRPC health says SERVING."""
        return Response(status_code=200 if serving() else 503)

    @router.get("/ping", operation_id="ping_get")
    @router.post("/ping", operation_id="ping_post")
    async def ping() -> Response:
        """SageMaker's health check, which vLLM serves: /health's answer."""
        return await health()

    @router.post("/tokenize", response_model=schemas.TokenizeResponse)
    async def tokenize(body: schemas.TokenizeRequest) -> Response:
        request = await asyncio.to_thread(translate.tokenize_request, body, served_model(),
                                          parsing.default_chat_template_kwargs)  # may render a chat
        if isinstance(request, list):
            token_ids, max_model_len = request, frontend.ready().info.max_model_len
        else:
            response = await frontend.tokenize(request)
            token_ids, max_model_len = list(response.token_ids), response.max_model_len
        strings = frontend.tokenizer.token_strings(token_ids) if body.return_token_strs and frontend.tokenizer else None
        return json_response(schemas.TokenizeResponse(count=len(token_ids), max_model_len=max_model_len,
                                                      tokens=token_ids, token_strs=strings))

    @router.post("/detokenize", response_model=schemas.DetokenizeResponse)
    async def detokenize(body: schemas.DetokenizeRequest) -> Response:
        try:
            response = frontend.detokenize(translate.detokenize_request(body, served_model()))
        except RequestFailed as e:
            raise translate.api_error(e, {"token_ids": "tokens"}) from e
        return json_response(schemas.DetokenizeResponse(prompt=response.text))

    return router


def lora_error(error: LoraRefused) -> ApiError:
    """An adapter the executor will not load or unload: 404 for a name not loaded, else 400 with the reason."""
    return ApiError(404 if error.code == "NOT_FOUND" else 400, str(error), "lora_name")


def metrics_router(registry: CollectorRegistry) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    def metrics() -> Response:
        """Prometheus' text format; a plain function, so Starlette renders it on a worker thread, off the event loop."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def create_metrics_app(registry: CollectorRegistry) -> FastAPI:
    """--metrics-port: ``/metrics`` and nothing else, open to any scraper that can reach it."""
    app = FastAPI(title="nanoserve metrics", openapi_url=None, docs_url=None, redoc_url=None)
    app.include_router(metrics_router(registry))
    return app


def answer_failures(app: FastAPI) -> None:
    """OpenAI's error shape for bad bodies (``install_handlers``) and for a ``RequestFailed`` a route let through:
    not ready, draining, or a refused tokenize, with fields named as OpenAI spells them."""
    install_handlers(app)

    @app.exception_handler(RequestFailed)
    async def request_failed(request: Request, error: RequestFailed) -> Response:
        return translate.api_error(error, {}).answer(request)


def create_app(frontend: Frontend, serving: Callable[[], bool], registry: CollectorRegistry,
               api_key: str = "", recording: RecordingControl | None = None, cors: Cors | None = ANY_ORIGIN,
               parsing: ChatParsing = NO_PARSING, load_tracking: bool = False,
               request_id_headers: bool = False, dev_mode: bool = False) -> FastAPI:
    """``serving``: what gRPC health would say (True: SERVING); ``registry``: what ``/metrics`` serves;
    ``recording``: the switch of ``/admin/recording``; ``cors``: None where another app in front answers browsers;
    ``parsing``: the flags that read chat answers; ``load_tracking``: whether ``/load`` counts (``http.load``);
    ``request_id_headers``: every answer carries ``X-Request-Id`` (``http.request_ids``); ``dev_mode``: vLLM's dev
    routes are served (``http.dev``)."""
    app = FastAPI(title="nanoserve", version=engine_version(), redoc_url=None,
                  description="The OpenAI-compatible API of a nanoserve scheduler, and what gateways probe.")
    app.openapi = without_validation_errors(app)
    answer_failures(app)
    app.include_router(generation_router(FrontendGenerating(frontend), parsing), responses=ERRORS)
    app.include_router(routes(frontend, serving, parsing), responses=ERRORS)
    app.include_router(gateway_router(frontend, served_by(frontend), parsing), responses=ERRORS)
    app.include_router(abort_router(frontend), responses=ERRORS)
    app.include_router(metrics_router(registry))
    track_load(app, load_tracking)
    if recording is not None:
        app.include_router(recording_router(recording))
    if dev_mode:
        app.include_router(dev_router(frontend), responses=ERRORS)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    request_ids.install(app, request_id_headers)
    if cors is not None:
        cors.install(app)
    return app
