"""HTTP errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the HTTP status table.

``STATUS_OF`` is the HTTP twin of ``grpc_status.STATUS_OF`` (gRPC): every way a request fails, one status
each. Bad JSON, a bad field type, an unknown route or method come out in the same shape; under Anthropic's
Messages API (``ANTHROPIC_PATHS``) in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from scheduler_svc.api.http.schemas import ErrorDetail, ErrorResponse
from scheduler_svc.core.errors import (
    CacheTooSmall,
    EngineFailure,
    ExecutorUnavailable,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    ServerStopping,
)

STATUS_OF: dict[type[RequestFailed], int] = {
    InvalidRequest: 400,
    # A restarted executor's cache cannot hold the request: retrying as it is will not help.
    CacheTooSmall: 400,
    QueueFull: 429,
    ServerStopping: 503,
    ExecutorUnavailable: 503,
    EngineFailure: 500,
}
# Anthropic's Messages API, whose errors take Anthropic's shape, and its error types by status.
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# OpenAI's error types and codes by status.
TYPE_OF = {401: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
CODE_OF = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 429: "rate_limit_exceeded",
           503: "service_unavailable"}


class ApiError(Exception):
    """An error answer: its status, OpenAI's error object, and the parameter to fix (if one is to blame)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=TYPE_OF.get(status, "invalid_request_error"), param=param,
                                  code=code or CODE_OF.get(status))

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.detail)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)

    def anthropic(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": str(self)}}

    def answer(self, request: Request) -> JSONResponse:
        """This error in the shape of the API the request called."""
        return self.answer_path(request.url.path.removeprefix(request.scope.get("root_path", "")))

    def answer_path(self, path: str) -> JSONResponse:
        if path.startswith(ANTHROPIC_PATHS):
            return JSONResponse(self.anthropic(), status_code=self.status)
        return self.response()


def top_level(path: str) -> str:
    """``messages[0].content`` -> ``messages``: OpenAI's ``param`` names the parameter itself."""
    return path.split("[", 1)[0].split(".", 1)[0]


def failure(error: RequestFailed, path: str | None = None) -> ApiError:
    """``error`` as an answer; ``path`` is the OpenAI parameter (``messages[1].role``) a refused field maps to."""
    if isinstance(error, InvalidRequest):
        return ApiError(STATUS_OF[InvalidRequest], f"{path}: {error.reason}", top_level(path))
    return ApiError(STATUS_OF[type(error)], str(error))


def invalid_body(error: RequestValidationError) -> ApiError:
    """pydantic's first complaint; ``param`` is the top-level field it is about, None for unparsable JSON."""
    first = error.errors()[0]
    loc = [part for part in first["loc"] if part != "body"]
    if not loc or not isinstance(loc[0], str):
        return ApiError(400, f"the request body is not a JSON object of this endpoint's parameters: {first['msg']}")
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
    return ApiError(400, f"{loc[0]}{path}: {first['msg']}", loc[0])


def install_handlers(app: FastAPI) -> None:
    """Every error the app or its framework raises leaves in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.answer(request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return invalid_body(error).answer(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").answer(request)
