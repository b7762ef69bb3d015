"""The admin routes: the recording's switch (``api.recording``), behind the API key like every route but /health and
/metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.recording import RecordingControl
from scheduler_svc.engine.recorder import RecordingStatus, RecordingUnavailable

# The gRPC status of RecordingUnavailable is FAILED_PRECONDITION: a state of the server, not of the request.
UNAVAILABLE_STATUS = 409


def recording_router(control: RecordingControl) -> APIRouter:
    router = APIRouter(prefix="/admin/recording")

    async def answer(work: Callable[[], Awaitable[RecordingStatus]]) -> JSONResponse:
        try:
            return JSONResponse(asdict(await work()))
        except RecordingUnavailable as e:
            raise ApiError(UNAVAILABLE_STATUS, str(e)) from e

    @router.get("")
    async def status() -> JSONResponse:
        async def read() -> RecordingStatus:
            return control.status()

        return await answer(read)

    @router.post("/start")
    async def start() -> JSONResponse:
        return await answer(control.start)

    @router.post("/stop")
    async def stop() -> JSONResponse:
        return await answer(control.stop)

    return router
