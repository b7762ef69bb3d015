"""The API process (``--api-process``): the public gRPC port, in a process of its own beside the scheduler's.

Writing a message per token to every stream costs a Python process about as much CPU as the scheduling, and in the
scheduler's process it shares the GIL with the engine loop, which an accelerator waits for between steps (W5
``api``). Here the streams are written by another process, as vLLM's API servers and SGLang's tokenizer manager write
theirs: the scheduler sends each step's outputs for every stream at once over a Unix socket (``api.process_link``),
and this process turns them into responses. Generate and GenerateOnce, and VllmEngine's Generate (through the proxy a
gateway's stream paid a second gRPC hop a message), are answered here; every other call is passed on to the scheduler's
internal socket (``api.grpc_proxy``). With --http-port the OpenAI HTTP API is served here too (``api.api_http``): its
completion routes from the link, every other route passed on to the scheduler's. The metrics port stays there.

The scheduler starts it (``api.api_link.ApiProcess``) with its settings in ``NANOSERVE_API_PROCESS_SETTINGS`` (JSON)
and stops it with a frame; it ends as well when the scheduler's end of the link closes. SIGINT and SIGTERM are left
to the scheduler, which drains the streams through here first.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import math
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field

import grpc
from google.protobuf.message import DecodeError
from smg_grpc_proto import vllm_engine_pb2 as vllm

from common.channels import DRAINED_KEY, message_size_options, server_options
from common.cpu_yield import give_way, thread_ids, yield_cpu
from common.heap import freeze_startup_heap
from common.security import ApiKeyInterceptor, TLSConfig, bind
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.api_http import Forwarder, LinkGenerating, LinkGeneration, create_api_app
from scheduler_svc.api.codec import responses, to_response
from scheduler_svc.api.grpc_proxy import GrpcProxy
from scheduler_svc.api.grpc_status import fail
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.cors import Cors
from scheduler_svc.api.http.server import HttpServer
from scheduler_svc.api.malformed import malformed
from scheduler_svc.api.outbox import Outbox
from scheduler_svc.api.pacing import PacedReading, WritePacer
from scheduler_svc.api.process_link import Frame, decode_output, pack, read_frame
from scheduler_svc.api.vllm_engine.requests import vllm_error
from scheduler_svc.api.vllm_engine.responses import ResponseWriter
from scheduler_svc.core.errors import InvalidRequest, RequestFailed
from scheduler_svc.core.outputs import RequestOutput

log = logging.getLogger("nanoserve.api")

ENV = "NANOSERVE_API_PROCESS_SETTINGS"
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE, GENERATE_ONCE = f"/{SERVICE}/Generate", f"/{SERVICE}/GenerateOnce"
VLLM_GENERATE = f"/{vllm.DESCRIPTOR.services_by_name['VllmEngine'].full_name}/Generate"
DRAINED_METADATA = ((DRAINED_KEY, "true"),)
# Allocations between two collections of the youngest generation (the collector's default is 700).
YOUNG_OBJECTS = 20_000


@dataclass(frozen=True)
class Settings:
    """What the scheduler hands this process: its link, its internal socket, and the public port's flags."""

    link: str
    internal: str
    host: str
    port: int
    max_message_bytes: int
    stream_interval: int
    log_level: str = "INFO"
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    api_key: str = ""
    # --http-port, served here, and the socket of the scheduler's HTTP routes (0 and "": no HTTP API)
    http_port: int = 0
    http_internal: str = ""
    cpu_share: float = 1.0  # --api-process-cpu-share
    # --allowed-origins, --allowed-credentials, --allowed-methods, --allowed-headers (``Cors``'s fields, as JSON)
    cors: dict[str, object] = field(default_factory=lambda: asdict(Cors()))
    # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser (``ChatParsing``'s fields)
    chat_parsing: dict[str, object] = field(default_factory=lambda: asdict(ChatParsing()))
    # --enable-server-load-tracking: /load counts the generation requests this process answers
    load_tracking: bool = False
    # --enable-request-id-headers: every HTTP answer carries X-Request-Id
    request_id_headers: bool = False


class Call:
    """One request sent over the link: its outputs, and whether (and as what) the scheduler took it."""

    def __init__(self, interval: float) -> None:
        self.outbox = Outbox(interval)
        # (request id, n, prompt length, prompt token ids or None) and, for VllmEngine, its ResponseWriter's reading
        self.accepted: asyncio.Future[tuple] = asyncio.get_running_loop().create_future()
        self.first_frame: int | None = None  # the link's count of the frame that brought its first outputs


class Link:
    """This process's end of the link (event-loop thread only)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 pacer: WritePacer | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.calls: dict[int, Call] = {}
        self._keys = itertools.count()
        self.stop_grace_s: float | None = None
        self._pacer = pacer
        self._held: list[tuple[Call, RequestOutput]] = []  # outputs the pacer holds back, in arrival order
        self._release: asyncio.TimerHandle | None = None
        self._frames = 0  # frames of outputs read
        self._reading = PacedReading()  # what streams take at a time (with a pacer only)

    def send(self, frame: Frame) -> None:
        self.writer.write(pack(frame))

    def submit(self, kind: str, data: bytes, interval: float, whole: bool) -> tuple[int, Call]:
        """``kind``: "submit" (nanoserve's GenerateRequest) or "submit_vllm" (VllmEngine's)."""
        key = next(self._keys)
        call = self.calls[key] = Call(interval)
        self.send((kind, key, data, whole))
        return key, call

    async def start(self, kind: str, data: bytes, interval: float, whole: bool) -> tuple[tuple, LinkGeneration]:
        """``submit`` and wait for the scheduler to take the request: its answer (``accepted``'s fields) and the
        request's outputs to read; raises the RequestFailed it was refused with. A caller gone meanwhile cancels it."""
        key, call = self.submit(kind, data, interval, whole)
        try:
            accepted = await call.accepted
        except BaseException:
            self.close(key, cancel=True)
            raise
        return accepted, LinkGeneration(self, key, call, *accepted[1:4])

    def ask(self, kind: str, *args: object) -> asyncio.Future[tuple]:
        """A question for the scheduler (``served``): its answer, or the RequestFailed it raised."""
        key = next(self._keys)
        call = self.calls[key] = Call(math.inf)
        self.send((kind, key, *args))
        call.accepted.add_done_callback(lambda _: self.calls.pop(key, None))
        return call.accepted

    def close(self, key: int, cancel: bool) -> None:
        if self.calls.pop(key, None) is not None and not self.writer.is_closing():
            self.send(("close", key, cancel))

    async def run(self) -> None:
        """Hand each frame on until the scheduler says stop or goes away."""
        if self._pacer is not None:
            self._pacer.handed_on()  # the start-up's CPU wrote nothing: pacing it would hold the first tokens back
        while (frame := await read_frame(self.reader)) is not None:
            kind = frame[0]
            if kind == "outputs":
                self._outputs(frame[1])
            elif kind == "accepted":
                self._settle(frame[1], lambda future, f=frame: future.set_result(f[2:]))
            elif kind == "failed":
                self._settle(frame[1], lambda future, f=frame: future.set_exception(f[2]))
                self.calls.pop(frame[1], None)
            elif kind == "yield_cpu":
                yield_cpu(thread_ids())
            elif kind == "beside_accelerator":
                give_way(thread_ids())
            elif kind == "stop":
                self.stop_grace_s = frame[1]
                break
        self._hand_on()

    def _outputs(self, items: list[tuple]) -> None:
        """A step's outputs into their calls' outboxes, now or, while the pacer says so, with the next ones. A
        request's first outputs go at once: pacing never holds a first token back (nothing of the call is held
        before them, so its order stands)."""
        calls, held = self.calls, self._held
        self._frames = frame = self._frames + 1
        for item in items:
            key, output = decode_output(item)
            if (call := calls.get(key)) is None:
                continue
            if call.first_frame is None:
                call.first_frame = frame
            if call.first_frame == frame:
                call.outbox.put_nowait(output)
            else:
                held.append((call, output))
        if self._release is not None or not held:
            return
        delay = self._pacer.delay() if self._pacer is not None else 0.0
        if delay > 0:
            self._release = asyncio.get_running_loop().call_later(delay, self._hand_on, True)
        else:
            self._hand_on()

    def _hand_on(self, paced: bool = False) -> None:
        """The held outputs into their calls' outboxes, in the order they came (``paced``: the pacer held them); the
        scheduler is told when what each stream takes at a time changes."""
        if self._release is not None:
            self._release.cancel()
        held, self._held, self._release = self._held, [], None
        for call, output in held:
            call.outbox.put_nowait(output)
        if self._pacer is None:
            return
        self._pacer.handed_on()
        tokens = sum(len(output.token_ids) for _, output in held) if paced else 0
        streams = len({id(call) for call, _ in held}) if paced else 0
        reading = self._reading.handed_on(paced, tokens, streams)
        if reading is not None and self.stop_grace_s is None and not self.writer.is_closing():
            self.send(("reading", reading))

    def _settle(self, key: int, settle) -> None:
        call = self.calls.get(key)
        if call is not None and not call.accepted.done():
            settle(call.accepted)


def _same(error: RequestFailed) -> RequestFailed:
    return error


def vllm_failure(error: RequestFailed) -> RequestFailed:
    """A refusal in the middle of a VllmEngine stream names the VllmEngine field, as in the scheduler's servicer."""
    return vllm_error(error) if isinstance(error, InvalidRequest) else error


class ApiHandler(grpc.GenericRpcHandler):
    """Generate, GenerateOnce and VllmEngine's Generate from the link; every other method through the proxy."""

    def __init__(self, link: Link, proxy: GrpcProxy, stream_interval: int) -> None:
        self.link = link
        self.proxy = proxy
        self.stream_interval = stream_interval

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == GENERATE:
            return grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateResponse.SerializeToString)
        if details.method == VLLM_GENERATE:
            return grpc.unary_stream_rpc_method_handler(
                self.vllm_generate, response_serializer=vllm.GenerateResponse.SerializeToString)
        if details.method == GENERATE_ONCE:
            return grpc.unary_unary_rpc_method_handler(
                self.generate_once, response_serializer=pb.GenerateResponse.SerializeToString)
        return self.proxy.handler(details.method)

    async def _parse(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateRequest:
        try:
            return pb.GenerateRequest.FromString(data)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed("Generate", e))

    async def _outputs(self, kind: str, data: bytes, whole: bool, interval: float,
                       context: grpc.aio.ServicerContext, failure: Callable[[RequestFailed], RequestFailed] = _same
                       ) -> AsyncIterator[tuple[tuple, list[RequestOutput]]]:
        """As ``Generation.batches``: what the scheduler answered when it took the request, and each batch of
        outputs until every choice ended; a failure ends the call with the status of ``failure(error)``."""
        try:
            accepted, generation = await self.link.start(kind, data, interval, whole)
        except RequestFailed as e:
            await fail(context, e)
        try:
            async for outputs in generation.batches():
                yield accepted, outputs
        except RequestFailed as e:
            await fail(context, failure(e))
        finally:
            generation.close()

    async def _interval(self, data: bytes, context: grpc.aio.ServicerContext) -> float:
        """Tokens a read of a nanoserve Generate stream takes (its request parsed here: bad bytes end the call)."""
        return (await self._parse(data, context)).stream_interval or self.stream_interval

    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        interval = await self._interval(data, context)
        first = True
        async for (request_id, n, _, prompt_token_ids), outputs in self._outputs("submit", data, False, interval,
                                                                               context):
            if outputs[-1].drained:  # read by clients that resume: ABORT here means "try elsewhere"
                context.set_trailing_metadata(DRAINED_METADATA)
            for response in responses(request_id, outputs, n == 1, prompt_token_ids if first else None):
                yield response
            first = False

    async def vllm_generate(self, data: bytes, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[vllm.GenerateResponse]:
        """VllmEngine's Generate, as ``vllm_engine.servicer`` answers it: translated in the scheduler, written here."""
        try:
            request = vllm.GenerateRequest.FromString(data)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed("Generate", e))
        interval = self.stream_interval if request.stream else math.inf
        writer = None
        async for accepted, outputs in self._outputs("submit_vllm", data, not request.stream, interval, context,
                                                     vllm_failure):
            if writer is None:
                prompt_ids, *asked = accepted[4]  # ResponseWriter.reading, done in the scheduler
                writer = ResponseWriter(prompt_ids, request.stream, *asked)
            for response in writer.responses(outputs):
                yield response

    async def generate_once(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        request = await self._parse(data, context)
        if request.sampling.n > 1:
            message = f"GenerateOnce returns one completion; stream {request.sampling.n} choices with Generate"
            await fail(context, InvalidRequest("sampling.n", message))
        batches = [(accepted, batch)
                   async for accepted, batch in self._outputs("submit", data, True, math.inf, context)]
        request_id, _, _, prompt_token_ids = batches[0][0]
        return to_response(request_id, [output for _, batch in batches for output in batch], prompt_token_ids)


async def serve(settings: Settings) -> None:
    reader, writer = await asyncio.open_unix_connection(settings.link)
    link = Link(reader, writer, WritePacer(settings.cpu_share) if settings.cpu_share < 1 else None)
    channel = grpc.aio.insecure_channel(settings.internal, options=message_size_options(settings.max_message_bytes))
    interceptors = [ApiKeyInterceptor(settings.api_key)] if settings.api_key else []
    server = grpc.aio.server(interceptors=interceptors, options=server_options(settings.max_message_bytes))
    server.add_generic_rpc_handlers([ApiHandler(link, GrpcProxy(channel), settings.stream_interval)])
    tls = TLSConfig.from_flags(settings.tls_cert, settings.tls_key, settings.tls_ca)
    forwarder = Forwarder(settings.http_internal) if settings.http_port else None
    try:
        port = bind(server, settings.host, settings.port, tls)
        http = None
        if forwarder is not None:
            cors = Cors(**{name: tuple(value) if isinstance(value, list) else value
                           for name, value in settings.cors.items()})
            app = create_api_app(LinkGenerating(link, settings.stream_interval), forwarder, settings.api_key, cors,
                                 ChatParsing(**settings.chat_parsing), settings.load_tracking,
                                 settings.request_id_headers)
            http = HttpServer(app, settings.host, settings.http_port, tls)
    except OSError as e:
        link.send(("failed_to_listen", str(e)))
        await writer.drain()
        return
    await server.start()
    if http is not None:
        http.start()
    link.send(("listening", port, http.port if http is not None else 0))
    freeze_startup_heap()
    # Each step's outputs are a few objects per stream, held a while when paced: at the collector's default of 700
    # allocations it ran every step or two and walked every stream's state each tenth time (W5 ``api``).
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
    await link.run()
    grace = link.stop_grace_s or 0
    await asyncio.gather(server.stop(grace), *([http.stop(grace)] if http is not None else []))
    if forwarder is not None:
        await forwarder.close()
    await channel.close()
    writer.close()


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    settings = Settings(**json.loads(os.environ.pop(ENV)))
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per route passed on, at INFO
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
