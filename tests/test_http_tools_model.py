"""A forced tool choice on real models, its grammar applied by the executor: "required" and a named function come
back as tool calls whose arguments validate against the tool's parameters, whole and streamed, at temperature 1 (the
grammar, not the model, makes them valid): the embedded SmolLM2 (whose template ignores the tools), and the tiny
random-weight Qwen3 with Qwen2.5's tool template (which shows them)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from tests.http_fixtures import Hosted, hosted, hosted_smollm2
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401
from tests.test_http_tools import QWEN_TOOLS_TEMPLATE, TOKENIZER, streamed_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now."}}]
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris for the next two days?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def api(smollm2_folder: Path) -> Iterator[Hosted]:  # noqa: F811 - converts the embedded model once
    with hosted_smollm2() as h:
        yield h


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_calls_that_validate(api: Hosted) -> None:
    client = api.openai()
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=64, temperature=1.0, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    valid(call.function.name, call.function.arguments)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                                 temperature=1.0, seed=3, stream=True))
    content, calls, finishes = streamed_calls(chunks)
    assert finishes[-1] == "tool_calls" and list(calls) == [0]
    valid(calls[0]["name"], calls[0]["arguments"])


def test_a_named_function_gets_arguments_that_validate(api: Hosted) -> None:
    client = api.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=48, temperature=1.0, seed=1)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "stop"
    valid("get_weather", call.function.arguments)
    content, calls, finishes = streamed_calls(list(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=48, temperature=1.0,
        seed=1, stream=True)))
    assert calls[0]["arguments"] == call.function.arguments and finishes[-1] == "stop"


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Hosted:  # noqa: F811
    """The tiny Qwen3 with the tests' tokenizer (its ids fit the tiny vocabulary; EOS 2 is <|im_end|>) and Qwen2.5's
    tool template."""
    folder = Path(shutil.copytree(tiny_model_folders["qwen3"], tmp_path_factory.mktemp("qwen3") / "tools"))
    (folder / "tokenizer.json").write_text(TOKENIZER.to_str())
    (folder / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), threads=2, kv_cache_memory=8 << 20))
    with hosted(executor) as h:
        yield h
        h.assert_idle()


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
# Short: the tiny model's length is 512 tokens, and this tokenizer's are about a character each.
SHORT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
               {"type": "function", "function": {"name": "time"}}]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_qwen3_with_tools_in_its_template_calls_them(tiny_qwen3: Hosted, streamed: bool) -> None:
    client = tiny_qwen3.openai()
    messages = [{"role": "user", "content": "Weather?"}]
    prompt = client.post("/chat/completions/render", cast_to=object,
                         body={"messages": messages, "tools": SHORT_TOOLS, "tool_choice": "none"})
    assert '"name": "weather"' in TOKENIZER.decode(prompt["token_ids"]) and len(prompt["token_ids"]) < 400
    request = {"model": client.models.list().data[0].id, "messages": messages, "tools": SHORT_TOOLS,
               "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 96, "temperature": 1.0,
               "seed": 7, "stream": streamed}  # one call: the array closes well within max_tokens
    reply = client.chat.completions.create(**request)
    if streamed:
        _, calls, finishes = streamed_calls(list(reply))
        got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        assert finishes[-1] == "tool_calls"
    else:
        got = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
        assert reply.choices[0].finish_reason == "tool_calls"
    assert got
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), CITY if name == "weather" else {"type": "object"})
