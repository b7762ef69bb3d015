"""vLLM's ``GET /load``: how many generation requests the HTTP API is answering now, from the moment one arrives
until its answer (a stream's last event included) is sent, where --enable-server-load-tracking counts them; 0
otherwise, as vLLM answers. A router reads it to send work where there is least."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

# The routes that run the model, as vLLM counts them (its /v1/responses/... too).
LOAD_AWARE = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations",
              "/inference/v1/generate")


class ServerLoad:
    """The count, and the route that reads it."""

    def __init__(self) -> None:
        self.requests = 0

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/load")
        async def load() -> JSONResponse:
            return JSONResponse({"server_load": self.requests})

        return router


class LoadTracking:
    """Counts each request to a ``LOAD_AWARE`` route in ``load`` while the app answers it."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or not path.startswith(LOAD_AWARE):
            await self.app(scope, receive, send)
            return
        self.load.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.requests -= 1


def track_load(app: FastAPI, tracking: bool) -> None:
    """``/load`` on ``app`` (a FastAPI app), counting where ``tracking``."""
    load = ServerLoad()
    app.include_router(load.router())
    if tracking:
        app.add_middleware(LoadTracking, load=load)
