"""Request bytes that are not the RPC's message: answered INVALID_ARGUMENT, like any other bad input.

gRPC Python answers a request it cannot deserialize with UNKNOWN; this interceptor hands the servicer a
``MalformedRequest`` instead, so the caller learns it was its own input (a proto out of date, a corrupt frame) and
gets the parser's reason. A unary method's call is refused here; a streaming method refuses it itself (a wrapper
around its generator would cost every response a hop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError


class MalformedRequest:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def malformed(method: str, reason: object) -> str:
    """What a caller whose bytes did not parse as ``method``'s request message is told."""
    return f"not {method}'s request message: {reason}"


async def refuse_malformed(request: object, context: grpc.aio.ServicerContext, method: str) -> None:
    """End the call with INVALID_ARGUMENT when ``request`` stands in for bytes that did not parse."""
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed(method, request.reason))


def tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except DecodeError as e:
            return MalformedRequest(str(e))

    return parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the request parser of every method of ``service`` (a full name, e.g. nanoserve.v1.Generation)."""

    def __init__(self, service: str) -> None:
        self.prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not details.method.startswith(self.prefix):
            return handler
        handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        if handler.unary_unary is None:
            return handler
        behavior, method = handler.unary_unary, details.method.removeprefix(self.prefix)

        async def refusing(request: object, context: grpc.aio.ServicerContext) -> object:
            await refuse_malformed(request, context, method)
            return await behavior(request, context)

        return handler._replace(unary_unary=refusing)
