"""``/openapi.json`` as the routes answer: FastAPI's schema of the request bodies and responses, with the errors this
API sends (OpenAI's error object, ``errors.STATUS_OF``) in place of FastAPI's 422 validation error, which it never
sends (a body that does not validate is a 400 naming the parameter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from scheduler_svc.api.http.schemas import ErrorResponse

# The errors any route may answer, besides its own 200.
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A parameter is refused; the error names it (param)."},
    401: {"model": ErrorResponse, "description": "The server has an API key and the request did not send it."},
    404: {"model": ErrorResponse, "description": "No such model (or route)."},
    429: {"model": ErrorResponse, "description": "Too many requests or prompt tokens wait; retry later."},
    503: {"model": ErrorResponse, "description": "Not serving yet, or shutting down."},
}
# Generation routes: a JSON body, or server-sent events with ``stream``.
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "One JSON object, or with stream an event stream of chunks ending in data: [DONE]."},
}


def without_validation_errors(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` that leaves FastAPI's 422 and its schemas out of the generated document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    return openapi
