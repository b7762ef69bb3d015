"""The Shepherd Model Gateway in gRPC mode in front of the embedded SmolLM2: it tokenizes with the tokenizer nanoserve
hands it over GetTokenizer, passes a json_schema response format on as VllmEngine's constraint, and the answer the
openai SDK reads validates against the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from tests.gateway_fixtures import TOKENIZER_LOADED, Gateway, running_gateway, smg_binary
from tests.http_fixtures import Hosted, hosted
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.service_fixtures import HOST

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Name a city and its population, as JSON."}]


@pytest.fixture(scope="module")
def served(smollm2_folder: Path) -> Hosted:  # noqa: F811 - converts the embedded model once
    smg_binary()
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=DEFAULT_MODEL, threads=2, kv_cache_memory=64 << 20))
    with hosted(executor) as h:
        yield h
        h.assert_idle()


@pytest.fixture(scope="module")
def gateway(served: Hosted, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    with running_gateway([f"grpc://{HOST}:{served.server.port}"], tmp_path_factory.mktemp("smg") / "smg.log",
                         ready={TOKENIZER_LOADED: 1}) as g:
        yield g


def test_a_json_schema_answer_through_the_gateway_validates(gateway: Gateway, served: Hosted) -> None:
    client = gateway.openai()
    model = client.models.list().data[0].id
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, temperature=1.0, seed=3,
                                            response_format=response_format)
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    direct = served.openai().chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    through = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.prompt_tokens == direct.usage.prompt_tokens
