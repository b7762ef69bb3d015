"""The API process (``--api-process``): the public gRPC port, in a process of its own beside the scheduler's.

Writing a message per token to every stream costs a Python process about as much CPU as the scheduling, and in the
scheduler's process it shares the GIL with the engine loop, which an accelerator waits for between steps (W5
``api``). Here the streams are written by another process, as vLLM's API servers and SGLang's tokenizer manager write
theirs: the scheduler sends each step's outputs for every stream at once over a Unix socket (``api.process_link``),
and this process turns them into responses. Generate and GenerateOnce are answered here; every other call is passed
on to the scheduler's internal socket (``api.grpc_proxy``). The HTTP API and the metrics port stay in the scheduler.

The scheduler starts it (``api.api_link.ApiProcess``) with its settings in ``NANOSERVE_API_PROCESS_SETTINGS`` (JSON)
and stops it with a frame; it ends as well when the scheduler's end of the link closes. SIGINT and SIGTERM are left
to the scheduler, which drains the streams through here first.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from common.channels import DRAINED_KEY, message_size_options, server_options
from common.cpu_yield import give_way, thread_ids, yield_cpu
from common.security import ApiKeyInterceptor, TLSConfig, bind
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.codec import responses, to_response
from scheduler_svc.api.grpc_proxy import GrpcProxy
from scheduler_svc.api.grpc_status import fail
from scheduler_svc.api.outbox import Outbox
from scheduler_svc.api.process_link import Frame, decode_output, pack, read_frame
from scheduler_svc.core.errors import InvalidRequest, RequestFailed
from scheduler_svc.core.outputs import RequestOutput

log = logging.getLogger("nanoserve.api")

ENV = "NANOSERVE_API_PROCESS_SETTINGS"
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE, GENERATE_ONCE = f"/{SERVICE}/Generate", f"/{SERVICE}/GenerateOnce"
DRAINED_METADATA = ((DRAINED_KEY, "true"),)


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


class Call:
    """One request sent over the link: its outputs, and whether (and as what) the scheduler took it."""

    def __init__(self, interval: float) -> None:
        self.outbox = Outbox(interval)
        self.accepted: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()


class Link:
    """This process's end of the link (event-loop thread only)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.calls: dict[int, Call] = {}
        self._keys = itertools.count()
        self.stop_grace_s: float | None = None

    def send(self, frame: Frame) -> None:
        self.writer.write(pack(frame))

    def submit(self, data: bytes, interval: float, whole: bool) -> tuple[int, Call]:
        key = next(self._keys)
        call = self.calls[key] = Call(interval)
        self.send(("submit", key, data, whole))
        return key, call

    def close(self, key: int, cancel: bool) -> None:
        if self.calls.pop(key, None) is not None and not self.writer.is_closing():
            self.send(("close", key, cancel))

    async def run(self) -> None:
        """Hand each frame on until the scheduler says stop or goes away."""
        while (frame := await read_frame(self.reader)) is not None:
            kind = frame[0]
            if kind == "outputs":
                calls = self.calls
                for item in frame[1]:
                    key, output = decode_output(item)
                    if (call := calls.get(key)) is not None:
                        call.outbox.put_nowait(output)
            elif kind == "accepted":
                self._settle(frame[1], lambda future, f=frame: future.set_result((f[2], f[3])))
            elif kind == "failed":
                self._settle(frame[1], lambda future, f=frame: future.set_exception(f[2]))
                self.calls.pop(frame[1], None)
            elif kind == "yield_cpu":
                yield_cpu(thread_ids())
            elif kind == "beside_accelerator":
                give_way(thread_ids())
            elif kind == "stop":
                self.stop_grace_s = frame[1]
                return

    def _settle(self, key: int, settle) -> None:
        call = self.calls.get(key)
        if call is not None and not call.accepted.done():
            settle(call.accepted)


class ApiHandler(grpc.GenericRpcHandler):
    """Generate and GenerateOnce from the link; every other method through the proxy."""

    def __init__(self, link: Link, proxy: GrpcProxy, stream_interval: int) -> None:
        self.link = link
        self.proxy = proxy
        self.stream_interval = stream_interval

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == GENERATE:
            return grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateResponse.SerializeToString)
        if details.method == GENERATE_ONCE:
            return grpc.unary_unary_rpc_method_handler(
                self.generate_once, response_serializer=pb.GenerateResponse.SerializeToString)
        return self.proxy.handler(details.method)

    async def _parse(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateRequest:
        try:
            return pb.GenerateRequest.FromString(data)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a GenerateRequest: {e}")

    async def _batches(self, data: bytes, whole: bool, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[tuple[str, int, list[RequestOutput]]]:
        """As ``Generation.batches``: (request id, n, outputs) until every choice ended; failures as statuses."""
        request = await self._parse(data, context)
        interval = float("inf") if whole else request.stream_interval or self.stream_interval
        key, call = self.link.submit(data, interval, whole)
        remaining = 1
        try:
            try:
                request_id, n = await call.accepted
            except RequestFailed as e:
                await fail(context, e)
            remaining = n
            while remaining:
                outputs = await call.outbox.take()
                error = outputs[-1].error
                if error is not None:
                    outputs.pop()
                if outputs:
                    remaining -= sum(output.finish_reason is not None for output in outputs)
                    yield request_id, n, outputs
                if error is not None:
                    await fail(context, error)
        finally:
            self.link.close(key, cancel=bool(remaining))

    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async for request_id, n, outputs in self._batches(data, False, context):
            if outputs[-1].drained:  # read by clients that resume: ABORT here means "try elsewhere"
                context.set_trailing_metadata(DRAINED_METADATA)
            for response in responses(request_id, outputs, n == 1):
                yield response

    async def generate_once(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        request = await self._parse(data, context)
        if request.sampling.n > 1:
            message = f"GenerateOnce returns one completion; stream {request.sampling.n} choices with Generate"
            await fail(context, InvalidRequest("sampling.n", message))
        batches = [(request_id, batch) async for request_id, _, batch in self._batches(data, True, context)]
        return to_response(batches[0][0], [output for _, batch in batches for output in batch])


async def serve(settings: Settings) -> None:
    reader, writer = await asyncio.open_unix_connection(settings.link)
    link = Link(reader, writer)
    channel = grpc.aio.insecure_channel(settings.internal, options=message_size_options(settings.max_message_bytes))
    interceptors = [ApiKeyInterceptor(settings.api_key)] if settings.api_key else []
    server = grpc.aio.server(interceptors=interceptors, options=server_options(settings.max_message_bytes))
    server.add_generic_rpc_handlers([ApiHandler(link, GrpcProxy(channel), settings.stream_interval)])
    tls = TLSConfig.from_flags(settings.tls_cert, settings.tls_key, settings.tls_ca)
    try:
        port = bind(server, settings.host, settings.port, tls)
    except OSError as e:
        link.send(("failed_to_listen", str(e)))
        await writer.drain()
        return
    await server.start()
    link.send(("listening", port))
    await link.run()
    await server.stop(link.stop_grace_s or 0)
    await channel.close()
    writer.close()


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    settings = Settings(**json.loads(os.environ.pop(ENV)))
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
