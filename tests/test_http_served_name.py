"""``--served-model-name`` as vLLM's: a request's ``model`` may give any of the names, and the first is the model's id
in every answer (/v1/models, the responses, /server_info, the metrics' label, VllmEngine's GetModelInfo); the
executor's model id is then only the cards' root (vLLM's model path), and a request naming it is refused."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc

from common.step import LoraAdapterInfo
from scheduler_svc.config import ServiceConfig, parse_config
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import HOST
from tests.test_service_options import echo

NAMES = ("llama-3", "llama")
MESSAGES = [{"role": "user", "content": "Hello world"}]


def test_the_flag_takes_one_or_more_names_and_the_environment_takes_them_separated_by_spaces():
    assert parse_config([], env={}).served_model_name == ServiceConfig().served_model_name == ()
    assert parse_config(["--served-model-name", *NAMES], env={}).served_model_name == NAMES
    assert parse_config([], env={"NANOSERVE_SERVED_MODEL_NAME": " llama-3  llama "}).served_model_name == NAMES
    flag_wins = parse_config(["--served-model-name", "x"], env={"NANOSERVE_SERVED_MODEL_NAME": "llama-3 llama"})
    assert flag_wins.served_model_name == ("x",)
    assert parse_config(["--served-model-name", "a", "b", "a"], env={}).served_model_name == ("a", "b")


@pytest.mark.parametrize(("argv", "env"), [(["--served-model-name"], {}), ([], {"NANOSERVE_SERVED_MODEL_NAME": " "})])
def test_no_name_is_refused(argv: list[str], env: dict[str, str]):
    with pytest.raises(SystemExit):
        parse_config(argv, env=env)


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    """The echo executor (model id "echo"), started with an adapter, served as NAMES."""
    executor = echo()
    executor.info = replace(executor.info, lora_adapters=(LoraAdapterInfo(1, "a1", "/adapters/a1", 8),),
                            max_lora_rank=8)
    executor.table.lora_ids = {1}
    with hosted(executor, served_model_name=NAMES, api_process=request.param) as h:
        yield h
        h.assert_idle()


def test_models_lists_each_name_with_the_executors_model_as_root_and_the_first_as_an_adapters_parent(api: Hosted):
    cards = httpx.get(f"{api.url}/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("llama-3", "echo", None), ("llama", "echo", None), ("a1", "/adapters/a1", "llama-3")]
    client = api.openai()
    assert client.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("echo")


def test_a_request_may_name_the_model_by_any_name_and_the_answer_gives_the_first(api: Hosted):
    client = api.openai()
    for model in NAMES:
        assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).model == "llama-3"
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).model == "llama-3"
        streamed = list(client.completions.create(model=model, prompt="Hi", max_tokens=2, stream=True))
        assert {chunk.model for chunk in streamed} == {"llama-3"}
    assert client.completions.create(prompt="Hi", max_tokens=2, model="a1").model == "a1"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="echo", prompt="Hi", max_tokens=2)
    assert (missing.value.param, missing.value.code) == ("model", "model_not_found"), "as vLLM: not a served name"
    tokenized = httpx.post(f"{api.url}/tokenize", json={"model": "llama", "prompt": "Hi"}, timeout=10)
    assert tokenized.status_code == 200
    rendered = httpx.post(f"{api.url}/v1/completions/render", json={"model": "llama", "prompt": "Hi"}, timeout=10)
    assert rendered.json()[0]["model"] == "llama-3"


def test_server_info_the_metrics_and_the_gateway_protocol_report_the_first_name(api: Hosted):
    info = httpx.get(f"{api.url}/server_info", timeout=10).json()
    assert (info["model"], info["served_model_name"]) == ("echo", "llama-3")
    metrics = httpx.get(f"{api.url}/metrics", timeout=10).text
    assert 'model_name="llama-3"' in metrics and 'model_name="echo"' not in metrics
    with grpc.insecure_channel(f"{HOST}:{api.server.port}") as channel:
        model = vllm_grpc.VllmEngineStub(channel).GetModelInfo(vllm.GetModelInfoRequest(), timeout=10)
    assert (model.served_model_name, model.model_path) == ("llama-3", "echo")


def test_without_the_flag_the_executors_model_id_is_the_name():
    with hosted(echo(), api_process=False) as h:
        assert [card.id for card in h.openai().models.list()] == ["echo"]
        assert httpx.get(f"{h.url}/server_info", timeout=10).json()["served_model_name"] == "echo"
        with grpc.insecure_channel(f"{HOST}:{h.server.port}") as channel:
            model = vllm_grpc.VllmEngineStub(channel).GetModelInfo(vllm.GetModelInfoRequest(), timeout=10)
        assert model.served_model_name == model.model_path == "echo"
