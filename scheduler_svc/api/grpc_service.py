"""The public Generation service (grpc.aio): translates messages and statuses, the engine loop does the work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.channels import DRAINED_KEY, server_options
from common.cpu_yield import thread_ids, yield_cpu
from common.executor import Executor, LoraRefused
from common.heap import freeze_startup_heap
from common.security import ApiKeyInterceptor, TLSConfig, bind, channel_credentials, transport_name
from common.step import ExecutorInfo
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from nanoserve.v1 import recording_pb2_grpc as rpb_grpc
from scheduler_svc.api.api_link import ApiProcess, private_folder, remove_folder
from scheduler_svc.api.codec import lora_card, responses, to_response
from scheduler_svc.api.delivery import deliver_to_event_loop, link_deliver
from scheduler_svc.api.frontend import Frontend, Generation
from scheduler_svc.api.grpc_status import fail
from scheduler_svc.api.http.app import create_app, create_metrics_app
from scheduler_svc.api.http.server import HttpServer, metrics_tls
from scheduler_svc.api.kv_events_config import parse_kv_events_config
from scheduler_svc.api.kv_zmq import ZmqKvPublisher
from scheduler_svc.api.malformed import MalformedRequestInterceptor, refuse_malformed
from scheduler_svc.api.recording import SERVICE_NAME as RECORDING_SERVICE
from scheduler_svc.api.recording import RecordingControl, RecordingServicer
from scheduler_svc.api.vllm_engine import servicer as vllm_engine
from scheduler_svc.config import ServiceConfig
from scheduler_svc.core.errors import InvalidRequest, RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.engine.admission import QueueLimits
from scheduler_svc.engine.backoff import Backoff
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor
from scheduler_svc.engine.loop import EngineLoop
from scheduler_svc.engine.metrics import Metrics, new_registry
from scheduler_svc.engine.recorder import Recorder, RecordingMetrics
from scheduler_svc.engine.recording_executor import RecordingExecutor
from scheduler_svc.engine.turn import Turn

log = logging.getLogger("nanoserve.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Trailing metadata of a stream the server ended with ABORT as it shut down (``common.channels.DRAINED_KEY``).
DRAINED_METADATA = ((DRAINED_KEY, "true"),)
# After the engine loop ended: time for the handlers to send their last responses.
SERVER_STOP_GRACE_S = 5.0
# How long a thread holds the GIL while another waits for it, in front of an accelerator (CPython's default: 5 ms).
# See ``set_gil_switch_interval``.
ACCELERATOR_GIL_SWITCH_INTERVAL_S = 0.0005


def connect_engine(executor: Executor, config: ServiceConfig) -> Engine:
    """Handshake with a reset executor: a new scheduler never inherits another one's requests."""
    executor.reset()
    return Engine(executor, config.scheduler_config(), **config.engine_options())


class GenerationServicer(pb_grpc.GenerationServicer):
    """gRPC in and out; the work around the engine loop is the ``Frontend``'s, shared with the HTTP API."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    _fail = staticmethod(fail)

    async def _ready(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.frontend.ready()
        except RequestFailed as e:
            await self._fail(context, e)

    async def _submit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                      whole: bool = False) -> Generation:
        await self._ready(context)
        await refuse_malformed(request, context, "Generate")
        try:
            return await self.frontend.submit(request, whole)
        except RequestFailed as e:
            await self._fail(context, e)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        with await self._submit(request, context) as generation:
            request_id, one_choice = generation.request_id, generation.prepared.params.n == 1
            prompt_token_ids = generation.prompt_token_ids
            try:
                async for outputs in generation.batches():
                    if outputs[-1].drained:  # read by clients that resume: ABORT here means "try elsewhere"
                        context.set_trailing_metadata(DRAINED_METADATA)
                    for response in responses(request_id, outputs, one_choice, prompt_token_ids):
                        yield response
                    prompt_token_ids = None
            except RequestFailed as e:
                await self._fail(context, e)

    async def GenerateOnce(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        if request.sampling.n > 1:
            message = f"GenerateOnce returns one completion; stream {request.sampling.n} choices with Generate"
            await self._fail(context, InvalidRequest("sampling.n", message))
        with await self._submit(request, context, whole=True) as generation:
            try:
                outputs = [output async for batch in generation.batches() for output in batch]
            except RequestFailed as e:
                await self._fail(context, e)
        return to_response(generation.request_id, outputs, generation.prompt_token_ids)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            return await self.frontend.tokenize(request)
        except RequestFailed as e:
            await self._fail(context, e)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            return self.frontend.detokenize(request)
        except RequestFailed as e:
            await self._fail(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Each request found ends with ABORT; its blocks are free before the next step."""
        await self._ready(context)
        return pb.AbortResponse(aborted_request_ids=self.frontend.abort(request.request_ids))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._ready(context)
        return self.frontend.model_info()

    async def LoadLoraAdapter(self, request: pb.LoadLoraRequest, context: grpc.aio.ServicerContext
                              ) -> pb.LoraAdapterCard:
        await self._ready(context)
        try:
            return lora_card(await self.frontend.load_lora(request.lora_name, request.lora_path, request.load_inplace))
        except LoraRefused as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraRequest, context: grpc.aio.ServicerContext
                                ) -> pb.LoraAdapterCard:
        await self._ready(context)
        try:
            return lora_card(await self.frontend.unload_lora(request.lora_name))
        except LoraRefused as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.SchedulerStats:
        await self._ready(context)
        return self.frontend.stats()


def executor_client(config: ServiceConfig, turn: Turn | None = None) -> RemoteExecutor:
    """The executor service at ``config.executor``, over TLS when an ``--executor-tls-*`` flag is set; ``turn``: the
    one the public API's readers give way to (``engine.turn``)."""
    tls = TLSConfig.from_flags(config.executor_tls_cert, config.executor_tls_key, config.executor_tls_ca)
    return RemoteExecutor(config.executor, step_timeout_s=config.step_timeout, turn=turn,
                          credentials=channel_credentials(tls) if tls else None, chat_template=config.chat_template)


class SchedulerServer:
    """The gRPC server, the HTTP API and the metrics port beside it on the same event loop, their health, and the
    engine loop once the executor answered."""

    def __init__(self, config: ServiceConfig, executor: Executor | None = None) -> None:
        """Serve ``executor`` (an in-process one in tests), or by default the executor service at config.executor."""
        self.config = config
        # Taken by the executor's stream from each step's result to the next plan; the API's readers give way to it.
        self.turn = Turn()
        self.frontend = Frontend(config.executor, config.stream_interval, self.turn, config.served_model_name)
        self.servicer = GenerationServicer(self.frontend)
        self.health = health.aio.HealthServicer()
        self.tls = TLSConfig.from_flags(config.tls_cert, config.tls_key, config.tls_ca)
        # With --api-process the public port is the API process's, and this server listens on a private socket.
        self.api_folder = private_folder() if config.api_process else None
        # With it and --http-port, the HTTP routes the API process passes on listen on this socket.
        self.internal_http = f"{self.api_folder}/http.sock" if self.api_folder and config.http_port else ""
        self.api: ApiProcess | None = None
        # The scheduler's metrics join the process' ones once the executor answered (they are labelled with its model).
        self.registry = new_registry()
        self.recorder = (Recorder(Path(config.record), config.record_text, config.record_max_file_bytes)
                         if config.record else None)
        if self.recorder is not None and config.record_at_start:
            self.recorder.start()
        self.registry.register(RecordingMetrics(lambda: self.recorder))
        self.recording = RecordingControl(self.recorder, lambda: self.loop)
        # The HTTP ports before gRPC's: a plain socket closes now, while a grpc.aio server a failed start left running
        # stops at the interpreter's exit (FastAPI's route cache keeps it), printing "Error in sys.excepthook".
        self.http: HttpServer | None = None
        self.metrics_http: HttpServer | None = None
        self.kv_publisher: ZmqKvPublisher | None = None
        try:
            if config.http_port:  # with --api-process, its public port is the API process's, which checks the key
                public = not self.api_folder
                app = create_app(self.frontend, self.is_serving, self.registry, config.api_key if public else "",
                                 self.recording, config.cors() if public else None, config.chat_parsing(),
                                 config.enable_server_load_tracking, config.enable_request_id_headers and public,
                                 config.server_dev_mode)
                self.http = (HttpServer(app, "", 0, None, unix_path=self.internal_http) if self.api_folder
                             else HttpServer(app, config.host, config.http_port, self.tls))
            if config.metrics_port:
                self.metrics_http = HttpServer(create_metrics_app(self.registry), config.host, config.metrics_port,
                                               metrics_tls(self.tls), "the metrics port")
            kv_events = parse_kv_events_config(config.kv_events_config) if config.kv_events_config else None
            if kv_events is not None and kv_events.publishes:
                self.kv_publisher = ZmqKvPublisher(kv_events)
            self.server, self.port = self._grpc_server(config)
        except BaseException:
            for server in self.http_servers:
                server.close()
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            if self.api_folder is not None:
                remove_folder(self.api_folder)
            raise
        self.executor = executor if executor is not None else executor_client(config, self.turn)
        # What the engine drives: the executor, recorded with --record.
        self.engine_executor = (RecordingExecutor(self.executor, self.recorder) if self.recorder is not None
                                else self.executor)
        self.loop: EngineLoop | None = None
        self.stopping = asyncio.Event()
        self.stopped = False
        # What health should say once the executor answered; the engine loop flips it on outages.
        self.serving = False
        self._health_lock = asyncio.Lock()

    def _grpc_server(self, config: ServiceConfig) -> tuple[grpc.aio.Server, int]:
        """The gRPC server, bound; its port (the one asked for, or the one picked for port 0)."""
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
        interceptors += [MalformedRequestInterceptor(name) for name in (SERVICE_NAME, vllm_engine.SERVICE_NAME)]
        server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        vllm_engine.add_to_server(self.frontend, self.is_serving, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        rpb_grpc.add_RecordingServicer_to_server(RecordingServicer(self.recording), server)
        reflection.enable_server_reflection((SERVICE_NAME, vllm_engine.SERVICE_NAME, RECORDING_SERVICE,
                                             health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        if self.api_folder is not None:
            server.add_insecure_port(self.internal_target)
            return server, 0
        return server, bind(server, config.host, config.port, self.tls)

    @property
    def internal_target(self) -> str:
        return f"unix:{self.api_folder}/grpc.sock"

    async def _sync_health(self) -> None:
        """Publish the current status; serialized, and each update reads the latest state, so the last one wins."""
        async with self._health_lock:
            serving = self.is_serving()
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME, vllm_engine.SERVICE_NAME):
                await self.health.set(name, status)

    def is_serving(self) -> bool:
        """What health says, over gRPC and HTTP: the executor answered and the server is not draining."""
        return self.serving and not self.stopping.is_set()

    def _on_serving(self, aio_loop: asyncio.AbstractEventLoop):
        """The engine loop's ``on_serving``: called on its thread, applied on the event loop."""

        def on_serving(serving: bool) -> None:
            self.serving = serving
            aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._sync_health()))

        return on_serving

    async def start(self) -> None:
        await self._sync_health()
        await self.server.start()
        if self.api_folder is not None:
            self.api = ApiProcess(self.config, self.frontend, self.internal_target, self.internal_http,
                                  self.api_folder)
            try:
                self.port, http_port = await self.api.start(self.stopping.set)
                if self.http is not None:
                    self.http.port = http_port
            except OSError:
                await self.server.stop(None)
                for server in self.http_servers:
                    server.close()
                if self.kv_publisher is not None:
                    self.kv_publisher.close()
                remove_folder(self.api_folder)
                raise
        for server in self.http_servers:
            server.start()
        http = f", HTTP on port {self.http.port}" if self.http is not None else ""
        if self.metrics_http is not None:
            http += f", metrics on port {self.metrics_http.port}"
        log.info("scheduler listening on %s:%d%s (%s%s) executor=%s", self.config.host, self.port, http,
                 transport_name(self.tls), ", API key" if self.config.api_key else "", self.config.executor)

    @property
    def http_servers(self) -> list[HttpServer]:
        return [server for server in (self.http, self.metrics_http) if server is not None]

    async def connect(self) -> bool:
        """Retry the executor handshake with exponential backoff; False if asked to stop first."""
        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                engine = await asyncio.to_thread(connect_engine, self.engine_executor, self.config)
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
        metrics = Metrics(self.frontend.model_names(info)[0], lambda: self.loop.stats, lambda: engine.info)
        deliver = deliver_to_event_loop(aio_loop, self.turn)
        self.loop = EngineLoop(engine, tokenizer, deliver if self.api is None else link_deliver(deliver), limits,
                               metrics, self._on_serving(aio_loop))
        self.registry.register(metrics)
        if self.kv_publisher is not None:
            engine.block_manager.listen()
            self.kv_publisher.start(engine.kv_events)
        self.loop.start()
        self.frontend.attach(self.loop, tokenizer, self.config.generation_config, self.config.reasoning_parser)
        self.serving = True
        await self._sync_health()
        log.info("executor ready model=%s blocks=%dx%d max_model_len=%d vocab=%d tokenizer=%s instance=%s policy=%s "
                 "overlap=%s", info.model_id, info.num_blocks, info.block_size, info.max_model_len, info.vocab_size,
                 "yes" if tokenizer else "no", info.instance_id, engine.config.policy, engine.overlap)
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
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.stop, "shutdown")
        if self.api is not None:
            await self.api.stop(SERVER_STOP_GRACE_S)
        servers = [self.server.stop(SERVER_STOP_GRACE_S), *(s.stop(SERVER_STOP_GRACE_S) for s in self.http_servers)]
        await asyncio.gather(*servers)
        if isinstance(self.executor, RemoteExecutor):
            self.executor.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.api_folder is not None:
            remove_folder(self.api_folder)


def set_gil_switch_interval(info: ExecutorInfo) -> None:
    """Let a thread that waits for the GIL have it sooner, unless the executor runs on the CPU.

    The engine loop thread shares the GIL with the event loop that writes every stream, and needs it after each
    step's result arrives, before it can send the plan the device computes next: W5 through the public API
    (``python -m bench.overlap --peers api``) keeps the simulated accelerator far busier at 0.5 ms than at CPython's
    5 ms. An executor on the CPU computes on the cores the scheduler runs on, and more GIL hand-overs only take more
    of them from it.
    """
    if not info.on_cpu:
        sys.setswitchinterval(ACCELERATOR_GIL_SWITCH_INTERVAL_S)


async def serve(config: ServiceConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see ``SchedulerServer.stop``)."""
    scheduler = SchedulerServer(config)
    await scheduler.start()
    aio_loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(signum, scheduler.stopping.set)
    if await scheduler.connect():
        set_gil_switch_interval(scheduler.loop.info)
        if scheduler.api is not None and not scheduler.loop.info.on_cpu:
            scheduler.api.beside_accelerator()
        if config.yield_cpu and scheduler.loop.info.on_cpu:
            log.debug("%d threads yield the CPU to the executor's forward pass", yield_cpu(thread_ids()))
            if scheduler.api is not None:
                scheduler.api.yield_cpu()
        freeze_startup_heap()
        await scheduler.stopping.wait()
    log.info("scheduler stopping: %.0fs for the requests in flight", config.shutdown_grace)
    await scheduler.stop()
    if scheduler.api is not None and scheduler.api.lost:
        raise OSError(scheduler.api.lost)
