"""vLLM's dev-mode routes (its VLLM_SERVER_DEV_MODE; here --server-dev-mode), served by the scheduler's app:
``/reset_prefix_cache`` for benchmarks that start each run cold, and ``/pause``, ``/resume``, ``/is_paused``, which
trainers call around a weight update (``engine.pause``)."""

from __future__ import annotations

from typing import get_args

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from scheduler_svc.api.frontend import Frontend
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.engine.pause import PauseLifted, PauseMode

DEV_ROUTES = ("/reset_prefix_cache", "/pause", "/resume", "/is_paused")


class ResetPrefixCache(BaseModel):
    success: bool


class PauseStatus(BaseModel):
    status: str


class IsPaused(BaseModel):
    is_paused: bool


def dev_router(frontend: Frontend) -> APIRouter:
    router = APIRouter()

    @router.post("/reset_prefix_cache", response_model=ResetPrefixCache)
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
        """The prefix cache's entries no request holds are dropped; ``success`` says whether none is left. There is
        no external (connector) cache to reset; running requests are not preempted for it."""
        if reset_running_requests:
            raise ApiError(400, "reset_running_requests: preempting the running requests to reset the cache is not "
                                "supported by this server; retry once they finish", "reset_running_requests")
        return JSONResponse({"success": await frontend.reset_prefix_cache()})

    @router.post("/pause", response_model=PauseStatus)
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        """New requests wait until ``/resume``; those in flight are aborted (``abort``), finish (``wait``: answered
        once they have) or stop where they are (``keep``). ``clear_cache``: the prefix cache is dropped once idle
        (not with ``keep``)."""
        if mode not in get_args(PauseMode):
            raise ApiError(400, f"mode: {mode!r} is none of abort, wait, keep", "mode")
        try:
            await frontend.pause(mode, clear_cache)
        except PauseLifted as e:
            raise ApiError(409, str(e)) from e
        return JSONResponse({"status": "paused"})

    @router.post("/resume", response_model=PauseStatus)
    async def resume() -> Response:
        """The requests held by the pause start, in their order."""
        await frontend.resume()
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused", response_model=IsPaused)
    async def is_paused() -> Response:
        return JSONResponse({"is_paused": frontend.is_paused()})

    return router
