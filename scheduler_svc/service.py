"""The public Generation service (grpc.aio): translates messages and statuses, the engine loop does the work."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.channels import message_size_options
from common.executor import Executor
from common.security import ApiKeyInterceptor, TLSConfig, bind, channel_credentials, transport_name
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.admission import QueueLimits
from scheduler_svc.backoff import Backoff
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.errors import (
    CacheTooSmall,
    EngineFailure,
    ExecutorUnavailable,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    ServerStopping,
)
from scheduler_svc.loop import EngineLoop, RequestHandle
from scheduler_svc.malformed import MalformedRequest, MalformedRequestInterceptor
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.remote import RemoteExecutor
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.tokenizer import ModelTokenizer
from scheduler_svc.validation import ModelLimits
from scheduler_svc.wire import detokenize, model_info, prepare, public_error, scheduler_stats, to_response, tokenize

log = logging.getLogger("nanoserve.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Every way a request can fail, and the status a caller sees for it.
STATUS_OF: dict[type[RequestFailed], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CacheTooSmall: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ServerStopping: grpc.StatusCode.UNAVAILABLE,
    ExecutorUnavailable: grpc.StatusCode.UNAVAILABLE,
    EngineFailure: grpc.StatusCode.INTERNAL,
}
# After the engine loop ended: time for the handlers to send their last responses.
SERVER_STOP_GRACE_S = 5.0


def connect_engine(executor: Executor, config: ServiceConfig) -> Engine:
    """Handshake with a reset executor: a new scheduler never inherits another one's requests."""
    executor.reset()
    return Engine(
        executor, SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.num_scheduler_steps),
        overlap=config.overlap, step_timeout_s=config.step_timeout,
    )


class GenerationServicer(pb_grpc.GenerationServicer):
    """Answers UNAVAILABLE until ``attach`` hands it the engine loop after the executor handshake."""

    def __init__(self, executor_target: str) -> None:
        self.executor_target = executor_target
        self.loop: EngineLoop | None = None
        self.tokenizer: ModelTokenizer | None = None
        # Requests in flight by the id the caller gave (or was given), for Abort; event-loop thread only.
        self.by_request_id: dict[str, set[RequestHandle]] = {}

    def attach(self, loop: EngineLoop, tokenizer: ModelTokenizer | None) -> None:
        self.loop, self.tokenizer = loop, tokenizer

    async def _ready(self, context: grpc.aio.ServicerContext) -> EngineLoop:
        if self.loop is None:
            message = f"the scheduler is still connecting to the executor at {self.executor_target}"
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        return self.loop

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, error: RequestFailed) -> None:
        """End the call with the status of ``error``; a refused field is named as GenerateRequest spells it."""
        if isinstance(error, InvalidRequest):
            error = public_error(error)
        await context.abort(STATUS_OF[type(error)], str(error))

    async def _submit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RequestHandle, asyncio.Queue[RequestOutput]]:
        loop = await self._ready(context)
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a GenerateRequest: {request.reason}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        try:
            prepared = await asyncio.to_thread(prepare, request, ModelLimits.of(loop.info), self.tokenizer)
            handle = loop.submit(prepared, queue)
        except RequestFailed as e:
            await self._fail(context, e)
        self.by_request_id.setdefault(prepared.request_id, set()).add(handle)
        return handle, queue

    def _done(self, handle: RequestHandle, finished: bool) -> None:
        """The call ended: forget its id; a request not finished (the caller went away) is cancelled."""
        handles = self.by_request_id[handle.prepared.request_id]
        handles.discard(handle)
        if not handles:
            del self.by_request_id[handle.prepared.request_id]
        if not finished:
            self.loop.cancel(handle)

    @staticmethod
    async def _next_outputs(
        queue: asyncio.Queue[RequestOutput], context: grpc.aio.ServicerContext
    ) -> list[RequestOutput]:
        """Everything produced since the last read, so a slow reader gets fewer, larger responses."""
        outputs = [await queue.get()]
        while not queue.empty() and not outputs[-1].is_last:
            outputs.append(queue.get_nowait())
        error = outputs[-1].error
        if error is not None:
            await GenerationServicer._fail(context, error)
        return outputs

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        handle, queue = await self._submit(request, context)
        remaining = handle.prepared.params.n
        try:
            while remaining:
                outputs = await self._next_outputs(queue, context)
                # One response per run of outputs of the same choice.
                for _, run in itertools.groupby(outputs, key=lambda output: output.index):
                    run = list(run)
                    remaining -= sum(output.finish_reason is not None for output in run)
                    yield to_response(handle.prepared.request_id, run)
        finally:
            self._done(handle, finished=not remaining)

    async def GenerateOnce(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        if not isinstance(request, MalformedRequest) and request.sampling.n > 1:
            message = f"GenerateOnce returns one completion; stream {request.sampling.n} choices with Generate"
            await self._fail(context, InvalidRequest("sampling.n", message))
        handle, queue = await self._submit(request, context)
        outputs: list[RequestOutput] = []
        try:
            while not outputs or not outputs[-1].is_last:
                outputs.extend(await self._next_outputs(queue, context))
        finally:
            self._done(handle, finished=bool(outputs) and outputs[-1].is_last)
        return to_response(handle.prepared.request_id, outputs)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        loop = await self._ready(context)
        try:
            token_ids = await asyncio.to_thread(tokenize, request, self.tokenizer)
        except RequestFailed as e:
            await self._fail(context, e)
        return pb.TokenizeResponse(token_ids=token_ids, count=len(token_ids), max_model_len=loop.info.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        loop = await self._ready(context)
        try:
            return pb.DetokenizeResponse(text=detokenize(request, self.tokenizer, loop.info.vocab_size))
        except RequestFailed as e:
            await self._fail(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Each request found ends with ABORT; its blocks are free before the next step."""
        loop = await self._ready(context)
        found = [request_id for request_id in dict.fromkeys(request.request_ids) if request_id in self.by_request_id]
        for request_id in found:
            for handle in self.by_request_id[request_id]:
                loop.cancel(handle, answer=True)
        return pb.AbortResponse(aborted_request_ids=found)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        loop = await self._ready(context)
        return model_info(loop.info, self.tokenizer)

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.SchedulerStats:
        loop = await self._ready(context)
        return scheduler_stats(loop.stats)


def deliver_to_event_loop(aio_loop: asyncio.AbstractEventLoop):
    """The engine loop's ``deliver``: one thread hop per step, then each output into its caller's queue."""

    def dispatch(batch: list[tuple[RequestHandle, RequestOutput]]) -> None:
        for handle, output in batch:
            handle.sink.put_nowait(output)

    def deliver(batch: list[tuple[RequestHandle, RequestOutput]]) -> None:
        aio_loop.call_soon_threadsafe(dispatch, batch)

    return deliver


def executor_client(config: ServiceConfig) -> RemoteExecutor:
    """The executor service at ``config.executor``, over TLS when an ``--executor-tls-*`` flag is set."""
    tls = TLSConfig.from_flags(config.executor_tls_cert, config.executor_tls_key, config.executor_tls_ca)
    credentials = channel_credentials(tls) if tls else None
    return RemoteExecutor(config.executor, step_timeout_s=config.step_timeout, credentials=credentials)


class SchedulerServer:
    """The gRPC server, its health status, and the engine loop once the executor answered."""

    def __init__(self, config: ServiceConfig, executor: Executor | None = None) -> None:
        """Serve ``executor`` (an in-process one in tests), or by default the executor service at config.executor."""
        self.config = config
        options = message_size_options(config.max_message_bytes)
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
        interceptors.append(MalformedRequestInterceptor(SERVICE_NAME))
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self.servicer = GenerationServicer(config.executor)
        self.health = health.aio.HealthServicer()
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.tls = TLSConfig.from_flags(config.tls_cert, config.tls_key, config.tls_ca)
        self.port = bind(self.server, config.host, config.port, self.tls)
        self.executor = executor if executor is not None else executor_client(config)
        self.loop: EngineLoop | None = None
        self.stopping = asyncio.Event()
        self.stopped = False
        # What health should say once the executor answered; the engine loop flips it on outages.
        self.serving = False
        self._health_lock = asyncio.Lock()

    async def _sync_health(self) -> None:
        """Publish the current status; serialized, and each update reads the latest state, so the last one wins."""
        async with self._health_lock:
            serving = self.serving and not self.stopping.is_set()
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

    def _on_serving(self, aio_loop: asyncio.AbstractEventLoop):
        """The engine loop's ``on_serving``: called on its thread, applied on the event loop."""

        def on_serving(serving: bool) -> None:
            self.serving = serving
            aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._sync_health()))

        return on_serving

    async def start(self) -> None:
        await self._sync_health()
        await self.server.start()
        log.info("scheduler listening on %s:%d (%s%s) executor=%s", self.config.host, self.port,
                 transport_name(self.tls), ", API key" if self.config.api_key else "", self.config.executor)

    async def connect(self) -> bool:
        """Retry the executor handshake with exponential backoff; False if asked to stop first."""
        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                engine = await asyncio.to_thread(connect_engine, self.executor, self.config)
                break
            except grpc.RpcError as e:
                delay = backoff.next()
                log.warning("executor %s not ready (%s: %s); retrying in %.1fs",
                            self.config.executor, e.code().name, e.details(), delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
        else:
            return False
        info = engine.info
        tokenizer = ModelTokenizer.from_info(info)
        aio_loop = asyncio.get_running_loop()
        limits = QueueLimits(self.config.max_queued_requests, self.config.max_queued_tokens)
        self.loop = EngineLoop(engine, tokenizer, deliver_to_event_loop(aio_loop), limits, self._on_serving(aio_loop))
        self.loop.start()
        self.servicer.attach(self.loop, tokenizer)
        self.serving = True
        await self._sync_health()
        log.info(
            "executor ready model=%s blocks=%dx%d max_model_len=%d vocab=%d tokenizer=%s instance=%s",
            info.model_id, info.num_blocks, info.block_size, info.max_model_len, info.vocab_size,
            "yes" if tokenizer else "no", info.instance_id,
        )
        return True

    async def stop(self) -> None:
        """NOT_SERVING and refuse new work; requests in flight get ``--shutdown-grace`` seconds, the rest ABORT."""
        if self.stopped:
            return
        self.stopped = True
        self.stopping.set()
        await self._sync_health()
        if self.loop is not None:
            grace = self.config.shutdown_grace
            await asyncio.to_thread(self.loop.stop, grace, grace + self.config.step_timeout)
        await self.server.stop(SERVER_STOP_GRACE_S)
        if isinstance(self.executor, RemoteExecutor):
            self.executor.close()


async def serve(config: ServiceConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see ``SchedulerServer.stop``)."""
    scheduler = SchedulerServer(config)
    await scheduler.start()
    aio_loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(signum, scheduler.stopping.set)
    if await scheduler.connect():
        await scheduler.stopping.wait()
    log.info("scheduler stopping: %.0fs for the requests in flight", config.shutdown_grace)
    await scheduler.stop()
