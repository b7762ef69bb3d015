"""Every way a request can fail, and the gRPC status a caller sees for it: one table for both gRPC services
(``nanoserve.v1.Generation`` and ``vllm.grpc.engine.VllmEngine``); HTTP has its twin in ``api.http.errors``."""

from __future__ import annotations

import grpc

from scheduler_svc.core.errors import (
    CacheTooSmall,
    EngineFailure,
    ExecutorUnavailable,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    ServerStopping,
)

STATUS_OF: dict[type[RequestFailed], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # A restarted executor's cache cannot hold the request: not busy, so retrying here as it is will not help.
    CacheTooSmall: grpc.StatusCode.FAILED_PRECONDITION,
    ServerStopping: grpc.StatusCode.UNAVAILABLE,
    ExecutorUnavailable: grpc.StatusCode.UNAVAILABLE,
    EngineFailure: grpc.StatusCode.INTERNAL,
}


async def fail(context: grpc.aio.ServicerContext, error: RequestFailed) -> None:
    """End the call with the status of ``error``."""
    await context.abort(STATUS_OF[type(error)], str(error))
