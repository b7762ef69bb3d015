"""What ``--api-key`` guards on the HTTP API: as vLLM's middleware, the paths under its API prefixes (``/v1``, ``/v2``,
``/inference``, ``/cohere``), and nanoserve's own ``/admin``; every other route (health, metrics, what gateways
probe, tokenizing) and any CORS preflight answer without the key."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from scheduler_svc.api.http.app import ApiKeyMiddleware
from tests.http_fixtures import hosted
from tests.test_service_options import echo

KEY = "s3cret"
GUARDED = ["/v1", "/v1/models", "/v1/chat/completions", "/v1/load_lora_adapter", "/v2/models", "/inference/v1/generate",
           "/cohere/v2/chat", "/admin/recording", "/admin/recording/start"]
OPEN = ["/", "/health", "/metrics", "/version", "/server_info", "/ping", "/load", "/tokenize", "/detokenize",
        "/docs", "/openapi.json", "/invocations"]


async def reached(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("reached")(scope, receive, send)


def status(method: str, path: str, headers: dict[str, str] | None = None, root_path: str = "") -> int:
    """The status the middleware in front of an app that answers 200 everywhere gives this request."""
    app = ApiKeyMiddleware(reached, KEY)

    async def call() -> int:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.request(method, root_path + path, headers=headers)).status_code

    return asyncio.run(call())


@pytest.mark.parametrize("path", GUARDED)
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_api_prefixes_and_admin_need_the_key(method: str, path: str):
    assert status(method, path) == 401
    assert status(method, path, {"authorization": "Bearer wrong"}) == 401
    assert status(method, path, {"authorization": f"Bearer {KEY}"}) == 200
    assert status(method, path, {"authorization": f"bearer {KEY}"}) == 200, "the scheme is case-insensitive"


@pytest.mark.parametrize("path", OPEN)
def test_every_other_path_is_open(path: str):
    assert status("GET", path) == status("POST", path) == 200


def test_a_preflight_never_needs_the_key():
    assert status("OPTIONS", "/v1/chat/completions") == 200


def test_the_prefixes_are_matched_below_the_root_path():
    assert status("GET", "/v1/models", root_path="/worker") == 401
    assert status("GET", "/version", root_path="/worker") == 200


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_a_gateway_reaches_what_it_probes_without_the_key(api_process: bool):
    # The Shepherd Model Gateway's HTTP mode tells a vLLM worker by /version; vLLM answers it, /server_info and the
    # tokenizer routes without the key.
    with hosted(echo(), api_key=KEY, api_process=api_process) as h:
        assert httpx.get(f"{h.url}/version", timeout=10).status_code == 200
        assert httpx.get(f"{h.url}/server_info", timeout=10).json()["model"] == "echo"
        tokens = httpx.post(f"{h.url}/tokenize", json={"prompt": "Hi"}, timeout=10).json()["tokens"]
        assert httpx.post(f"{h.url}/detokenize", json={"tokens": tokens}, timeout=10).json()["prompt"] == "Hi"
        for path in ("/v1/models", "/admin/recording"):
            refused = httpx.get(f"{h.url}{path}", timeout=10)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{h.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
