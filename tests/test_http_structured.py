"""The OpenAI API's response_format on the embedded model: a json_schema completion parses and validates, at
temperature 1, non-streamed and streamed; json_object gives a JSON object; vLLM's structured_outputs choice holds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from executor_svc.runtime.registry import DEFAULT_MODEL
from tests.http_fixtures import Hosted, hosted_smollm2
from tests.model_fixtures import smollm2_folder  # noqa: F401

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Name a city and its population, as JSON."}]


@pytest.fixture(scope="module")
def api(smollm2_folder: Path) -> Iterator[Hosted]:  # noqa: F811 - converts the embedded model once
    with hosted_smollm2() as h:
        yield h


def test_a_json_schema_response_validates_at_temperature_1(api: Hosted) -> None:
    client = api.openai()
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=48,
                                                temperature=1.0, seed=seed, response_format=response_format)
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=48, temperature=1.0,
                                            seed=5, response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_choice_constraints_hold(api: Hosted) -> None:
    client = api.openai()
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=48, temperature=1.0,
                                            seed=1, response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    picked = client.completions.create(model=DEFAULT_MODEL, prompt="Is water wet? Answer:", max_tokens=4,
                                       temperature=1.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert picked.choices[0].text in ("yes", "no")
