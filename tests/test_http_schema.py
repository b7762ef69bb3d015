"""``/openapi.json`` describes what each route accepts, and schemathesis, sending what that schema allows and what it
does not (a bounded number of examples per route), never gets a server error back."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry
from schemathesis.checks import not_a_server_error

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.api.frontend import Frontend
from scheduler_svc.api.http.app import create_app
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

# Per route and generation mode; each example with a generation costs at most MAX_MODEL_LEN shadow steps.
EXAMPLES_PER_ROUTE = 25
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def api() -> Hosted:
    executor = ShadowExecutor(num_blocks=256, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE,
                              max_model_len=MAX_MODEL_LEN, tokenizer_json=byte_level_tokenizer().to_str(),
                              chat_template=CHATML_TEMPLATE)
    with hosted(executor) as h:
        yield h
        h.assert_idle()


# The schema the app serves, made without a server (the routes need the engine only to answer).
schema = schemathesis.openapi.from_dict(create_app(Frontend("none"), lambda: True, CollectorRegistry()).openapi())


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_route_answers_with_a_server_error(case: schemathesis.Case, api: Hosted) -> None:
    case.call_and_validate(base_url=api.url, checks=[not_a_server_error])


def test_the_schema_lists_every_route_with_its_body_and_error_shape(api: Hosted) -> None:
    document = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    paths = document["paths"]
    assert set(paths) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health",
                          "/tokenize", "/detokenize", "/metrics", "/version", "/server_info", "/v1/completions/render",
                          "/v1/chat/completions/render", "/admin/recording", "/admin/recording/start",
                          "/admin/recording/stop", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/ping",
                          "/invocations", "/v1/responses", "/v1/responses/{response_id}",
                          "/v1/responses/{response_id}/cancel", "/load", "/v1/messages",
                          "/v1/messages/count_tokens", "/inference/v1/generate", "/inference/v1/abort_requests",
                          "/v1/chat/completions/batch"}
    bodies = {path: op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
              for path, op in paths.items() if "requestBody" in op.get("post", {})}
    assert bodies == {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
                      "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
                      "/v1/completions/render": "CompletionRenderRequest",
                      "/v1/chat/completions/render": "ChatCompletionRenderRequest",
                      "/v1/load_lora_adapter": "LoadLoraAdapterRequest",
                      "/v1/unload_lora_adapter": "UnloadLoraAdapterRequest", "/v1/responses": "ResponsesRequest",
                      "/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest",
                      "/inference/v1/generate": "GenerateRequest", "/inference/v1/abort_requests": "AbortRequests",
                      "/v1/chat/completions/batch": "BatchChatCompletionRequest"}
    for operations in paths.values():
        for operation in operations.values():
            assert "422" not in operation["responses"], "FastAPI's 422 is never sent: a bad body is a 400"
            if "requestBody" in operation:
                assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "ErrorResponse")
    render = document["components"]["schemas"]["CompletionRenderRequest"]
    assert "model" not in render.get("required", []) and "prompt" in render["required"]
    page = httpx.get(f"{api.url}/docs", timeout=10)
    assert page.status_code == 200 and "/openapi.json" in page.text
