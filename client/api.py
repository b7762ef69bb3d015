"""Python clients of the scheduler's public API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Each holds one channel for its whole life, as the server expects of long-lived callers; given several
servers (``servers=``, a comma list or a ``dns:///`` target) the channel balances them with round_robin.
Every generation method takes a text ``prompt`` or ``messages=`` or ``token_ids=`` plus the
options of ``client.request_builder.build_request``; failures raise ``NanoserveError``. A stream whose
scheduler dies is resumed on another (``client.failover``), so the caller sees one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.errors import NanoserveError
from client.failover import DEFAULT_MAX_RESUMES, ROUND_ROBIN, Resumption, channel_target, one_choice, read_whole
from client.request_builder import Message, build_request, tokenize_request
from client.results import Chunk, Completion
from common.channels import PUBLIC_MAX_MESSAGE_BYTES, public_channel_options
from common.security import TLSConfig, channel_credentials
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def channel_args(target: str, servers: Sequence[str] | None, max_message_bytes: int) -> tuple[str, list]:
    """The gRPC target and options of a channel to ``target`` or to ``servers``, balanced when several."""
    target, balanced = channel_target(target, None if servers is None else list(servers))
    options = public_channel_options(max_message_bytes)
    return target, [*options, ROUND_ROBIN] if balanced else options


def lora_request(name: str, path: str, load_inplace: bool) -> pb.LoadLoraRequest:
    return pb.LoadLoraRequest(lora_name=name, lora_path=path, load_inplace=load_inplace)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The bearer token a scheduler started with --api-key (or a gateway in front of it) asks for."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    """A blocking client; use it as a context manager or call ``close()``.

    ``tls`` connects over TLS, verifying the server with ``tls.ca_file`` (the system roots when
    unset) and presenting ``tls.cert_file``/``key_file`` to a server that wants a client certificate.
    ``servers`` (``["h1:50051", "h2:50051"]``) replaces ``target``; ``max_resumes`` bounds the resends of one
    stream after UNAVAILABLE (0: none). ``timeout`` bounds a whole call, resends included.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None, max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES,
                 servers: Sequence[str] | None = None, max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self.target, options = channel_args(target, servers, max_message_bytes)
        # Balanced over several schedulers: a stream one of them drains is resumed on another.
        self.balanced = ROUND_ROBIN in options
        self.timeout = timeout
        self.max_resumes = max_resumes
        self.metadata = call_metadata(api_key)
        if tls is None:
            self.channel = grpc.insecure_channel(self.target, options=options)
        else:
            self.channel = grpc.secure_channel(self.target, channel_credentials(tls), options=options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: str | None = None, **options: Any) -> Completion:
        """The whole completion: streamed (``JOINED_STREAM_INTERVAL`` tokens a response unless ``stream_interval``
        is given) and joined, so that it survives its scheduler's death. One completion: ``choices`` returns the n
        of n > 1 (ValueError here)."""
        return Completion.from_chunks(list(self._stream(read_whole(one_choice(build_request(prompt, **options))))))[0]

    def stream(self, prompt: str | None = None, **options: Any) -> Iterator[Chunk]:
        """Chunks as the server decodes them; closing the iterator early cancels the request.

        The request is checked here, so a bad argument raises at the call, not at the first chunk.
        """
        return self._stream(build_request(prompt, **options))

    def _stream(self, request: pb.GenerateRequest) -> Iterator[Chunk]:
        """The chunks of ``request``, resent with ``resume`` after UNAVAILABLE (see ``client.failover``)."""
        resumption = Resumption(request, self.timeout, self.max_resumes, self.balanced)
        while True:
            responses = self.stub.Generate(resumption.attempt(), timeout=resumption.remaining_s(),
                                           metadata=self.metadata)
            try:
                for response in responses:
                    for ready in resumption.receive(response):
                        yield Chunk.from_proto(ready)
                delay, rest = resumption.finish(responses.trailing_metadata())
                for ready in rest:
                    yield Chunk.from_proto(ready)
                if delay is None:
                    return
            except grpc.RpcError as e:
                delay, rest = resumption.retry_delay(e)
                if delay is None:
                    raise NanoserveError.from_rpc_error(e) from None
                for ready in rest:
                    yield Chunk.from_proto(ready)
            finally:
                responses.cancel()
            time.sleep(delay)

    def chat(self, messages: Sequence[Message], **options: Any) -> Completion:
        """A reply to ``messages`` ({"role", "content"} dicts), rendered with the model's chat template."""
        return self.generate(messages=messages, **options)

    def choices(self, prompt: str | None = None, **options: Any) -> list[Completion]:
        """All ``n`` completions of one request (streamed, then gathered), in index order."""
        return Completion.from_chunks(list(self.stream(prompt, **options)))

    def tokenize(self, text: str | None = None, messages: Sequence[Message] | None = None,
                 add_special_tokens: bool | None = None,
                 chat_template_kwargs: Mapping[str, object] | None = None) -> list[int]:
        """The token ids a prompt costs, as Generate would see them."""
        request = tokenize_request(text, messages, add_special_tokens, chat_template_kwargs)
        return list(self._unary(self.stub.Tokenize, request).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self.stub.Detokenize, request).text

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort requests by id; returns those that were in flight (now ended with ABORT)."""
        return list(self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids)).aborted_request_ids)

    def model_info(self) -> pb.ModelInfo:
        """The served model and the limits a request must respect."""
        return self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    def stats(self) -> pb.SchedulerStats:
        """Live queue and KV-block counters."""
        return self._unary(self.stub.GetStats, pb.GetStatsRequest())

    def load_lora(self, name: str, path: str, *, load_inplace: bool = False) -> pb.LoraAdapterCard:
        """Load a PEFT LoRA adapter (a folder on the executor's machine) as ``name``; requests then pass ``lora=name``.
        Refused unless the executor runs with --runtime-lora. ``load_inplace``: replace the adapter already served
        as ``name`` (vLLM's option; refused while requests use it)."""
        return self._unary(self.stub.LoadLoraAdapter, lora_request(name, path, load_inplace))

    def unload_lora(self, name: str) -> pb.LoraAdapterCard:
        """Unload an adapter: new requests naming it are refused at once, the ones through it run to their end (the
        server drops its weights then); NOT_FOUND if none is served under ``name``."""
        return self._unary(self.stub.UnloadLoraAdapter, pb.UnloadLoraRequest(lora_name=name))

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name, e.g. "SERVING" or "NOT_SERVING"."""
        response = self._unary(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise NanoserveError.from_rpc_error(e) from None


class AsyncClient:
    """The asyncio twin of ``Client``; its channel opens on first use, inside the running event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None, max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES,
                 servers: Sequence[str] | None = None, max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self.target, self.options = channel_args(target, servers, max_message_bytes)
        self.balanced = ROUND_ROBIN in self.options
        self.timeout = timeout
        self.max_resumes = max_resumes
        self.metadata = call_metadata(api_key)
        self.tls = tls
        self.channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._health_stub: health_pb2_grpc.HealthStub | None = None

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        self._connect()
        return self._stub

    @property
    def health_stub(self) -> health_pb2_grpc.HealthStub:
        self._connect()
        return self._health_stub

    async def generate(self, prompt: str | None = None, **options: Any) -> Completion:
        """The whole completion, streamed and joined as ``Client.generate`` does."""
        request = read_whole(one_choice(build_request(prompt, **options)))
        return Completion.from_chunks([chunk async for chunk in self._stream(request)])[0]

    def stream(self, prompt: str | None = None, **options: Any) -> AsyncIterator[Chunk]:
        """Chunks as the server decodes them (``async for``); leaving the loop early cancels the request."""
        return self._stream(build_request(prompt, **options))

    async def _stream(self, request: pb.GenerateRequest) -> AsyncIterator[Chunk]:
        resumption = Resumption(request, self.timeout, self.max_resumes, self.balanced)
        while True:
            call = self.stub.Generate(resumption.attempt(), timeout=resumption.remaining_s(), metadata=self.metadata)
            try:
                async for response in call:
                    for ready in resumption.receive(response):
                        yield Chunk.from_proto(ready)
                delay, rest = resumption.finish(await call.trailing_metadata())
                for ready in rest:
                    yield Chunk.from_proto(ready)
                if delay is None:
                    return
            except grpc.RpcError as e:
                delay, rest = resumption.retry_delay(e)
                if delay is None:
                    raise NanoserveError.from_rpc_error(e) from None
                for ready in rest:
                    yield Chunk.from_proto(ready)
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def chat(self, messages: Sequence[Message], **options: Any) -> Completion:
        """A reply to ``messages`` ({"role", "content"} dicts), rendered with the model's chat template."""
        return await self.generate(messages=messages, **options)

    async def choices(self, prompt: str | None = None, **options: Any) -> list[Completion]:
        """All ``n`` completions of one request (streamed, then gathered), in index order."""
        return Completion.from_chunks([chunk async for chunk in self.stream(prompt, **options)])

    async def tokenize(self, text: str | None = None, messages: Sequence[Message] | None = None,
                       add_special_tokens: bool | None = None,
                       chat_template_kwargs: Mapping[str, object] | None = None) -> list[int]:
        request = tokenize_request(text, messages, add_special_tokens, chat_template_kwargs)
        return list((await self._unary(self.stub.Tokenize, request)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self.stub.Detokenize, request)).text

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        response = await self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids))
        return list(response.aborted_request_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    async def stats(self) -> pb.SchedulerStats:
        return await self._unary(self.stub.GetStats, pb.GetStatsRequest())

    async def load_lora(self, name: str, path: str, *, load_inplace: bool = False) -> pb.LoraAdapterCard:
        """As ``Client.load_lora``."""
        return await self._unary(self.stub.LoadLoraAdapter, lora_request(name, path, load_inplace))

    async def unload_lora(self, name: str) -> pb.LoraAdapterCard:
        """As ``Client.unload_lora``."""
        return await self._unary(self.stub.UnloadLoraAdapter, pb.UnloadLoraRequest(lora_name=name))

    async def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name, e.g. "SERVING" or "NOT_SERVING"."""
        response = await self._unary(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _connect(self) -> None:
        if self.channel is None:
            if self.tls is None:
                self.channel = grpc.aio.insecure_channel(self.target, options=self.options)
            else:
                self.channel = grpc.aio.secure_channel(self.target, channel_credentials(self.tls),
                                                       options=self.options)
            self._stub = pb_grpc.GenerationStub(self.channel)
            self._health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise NanoserveError.from_rpc_error(e) from None
