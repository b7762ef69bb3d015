"""Every gRPC method the API process does not answer itself, passed on to the scheduler service as bytes.

The API process (``api.api_process``) answers Generate and GenerateOnce from its link; any other call of the
public port (model info, tokenizing, Abort, stats, LoRA, health, reflection, recording, vLLM's engine protocol) goes
through unchanged: its bytes, the caller's metadata and deadline in, the response bytes or the status, details and
trailing metadata out. A method the scheduler does not serve is UNIMPLEMENTED, as on the scheduler itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import descriptor_pool

# The scheduler's services, so that the pool knows each method's shape.
from grpc_health.v1 import health_pb2  # noqa: F401
from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401
from smg_grpc_proto import vllm_engine_pb2  # noqa: F401

from nanoserve.v1 import generation_pb2, recording_pb2  # noqa: F401

# Headers gRPC sets itself on every call: not the caller's to pass on.
TRANSPORT_HEADERS = frozenset({"user-agent", "content-type", "te"})


def passed_on(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata (its API key among it), less what gRPC sets on the call it makes."""
    return tuple((key, value) for key, value in context.invocation_metadata() or ()
                 if not key.startswith((":", "grpc-")) and key not in TRANSPORT_HEADERS)


class GrpcProxy:
    """Builds the handler that passes one method on over ``channel`` (the scheduler's internal socket)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def handler(self, method: str) -> grpc.RpcMethodHandler | None:
        """``method`` as gRPC names it (``/package.Service/Method``); None when the scheduler has no such method."""
        service, _, name = method.lstrip("/").rpartition("/")
        try:
            descriptor = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
        except KeyError:
            return None
        if descriptor is None:
            return None
        if descriptor.client_streaming:
            make = self.stream_stream if descriptor.server_streaming else self.stream_unary
            wrap = (grpc.stream_stream_rpc_method_handler if descriptor.server_streaming
                    else grpc.stream_unary_rpc_method_handler)
        else:
            make = self.unary_stream if descriptor.server_streaming else self.unary_unary
            wrap = (grpc.unary_stream_rpc_method_handler if descriptor.server_streaming
                    else grpc.unary_unary_rpc_method_handler)
        return wrap(make(method))

    def unary_unary(self, method: str):
        callable_ = self.channel.unary_unary(method)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = callable_(request, metadata=passed_on(context), timeout=context.time_remaining())
            return await _answer(call, context, call)

        return handle

    def stream_unary(self, method: str):
        callable_ = self.channel.stream_unary(method)

        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            call = callable_(requests, metadata=passed_on(context), timeout=context.time_remaining())
            return await _answer(call, context, call)

        return handle

    def unary_stream(self, method: str):
        callable_ = self.channel.unary_stream(method)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = callable_(request, metadata=passed_on(context), timeout=context.time_remaining())
            async for response in _relay(call, context):
                yield response

        return handle

    def stream_stream(self, method: str):
        callable_ = self.channel.stream_stream(method)

        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = callable_(requests, metadata=passed_on(context), timeout=context.time_remaining())
            async for response in _relay(call, context):
                yield response

        return handle


async def _answer(awaitable, context: grpc.aio.ServicerContext, call: grpc.aio.Call) -> bytes:
    try:
        response = await awaitable
    except grpc.aio.AioRpcError as e:
        await _abort(context, e)
    if initial := await call.initial_metadata():
        await context.send_initial_metadata(tuple(initial))
    context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
    return response


async def _relay(call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall,
                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    try:
        # Sent on as soon as they come: a subscriber may wait for them (the gateway's KV-events stream does).
        await context.send_initial_metadata(tuple(await call.initial_metadata() or ()))
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as e:
        await _abort(context, e)
    context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))


async def _abort(context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError) -> None:
    await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
