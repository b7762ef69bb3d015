"""LoRA adapters through the two-service stack (an executor process and a scheduler process), on SmolLM2 and a tiny
Qwen3: the base model and two adapters in one batch give each request its adapter's transformers + peft tokens over
gRPC and over the OpenAI API; adapters load and unload at run time while streams run, never disturbing them."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.lora_fixtures import ALL_PROJECTIONS, peft_greedy, save_random_adapter
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401
from tests.service_fixtures import HOST, Stack, assert_idle, free_port, running_stack, stream, token_request

MAX_NEW_TOKENS = 8
ADAPTERS = {"a1": (ALL_PROJECTIONS, 8), "a2": (["q_proj", "v_proj", "down_proj"], 4)}


@dataclass
class Served:
    stack: Stack
    http: str
    prompts: list[list[int]]
    adapters: dict[str, Path]
    # By adapter name ("" for the base model): the reference completion of each prompt.
    reference: dict[str, list[list[int]]]


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if request.param == "smollm2":
        base, vocab = request.getfixturevalue("smollm2_folder"), 49152
    else:
        base, vocab = request.getfixturevalue("tiny_model_folders")["qwen3"], 512
    root = tmp_path_factory.mktemp(f"lora-stack-{request.param}")
    adapters = {name: save_random_adapter(base, root / name, targets, rank, seed=i + 11, scale=2.0)
                for i, (name, (targets, rank)) in enumerate(ADAPTERS.items())}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (6, 23)]
    reference = {name: peft_greedy(base, adapters.get(name), prompts, MAX_NEW_TOKENS) for name in ("", *ADAPTERS)}
    executor_port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "executor_svc", "--host", HOST, "--port", str(executor_port), "--model", str(base),
            "--dtype", "float32", "--kv-cache-memory", "64M", "--block-size", "8", "--threads", "2",
            "--runtime-lora", "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    with running_stack(argv, root / "logs", executor_port, http_port=http_port, max_loras=2) as stack:
        yield Served(stack, f"http://{HOST}:{http_port}", prompts, adapters, reference)


def test_base_and_two_adapters_in_one_batch_over_grpc_and_http(served: Served) -> None:
    async def all_at_once() -> list[list[int]]:
        async with grpc.aio.insecure_channel(served.stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            requests = []
            for name in ("", *ADAPTERS):
                for prompt in served.prompts:
                    request = token_request(prompt, MAX_NEW_TOKENS, ignore_eos=True)
                    request.sampling.temperature, request.lora = 0.0, name
                    requests.append(request)
            return [c.token_ids for c in await asyncio.gather(*(stream(stub, r) for r in requests))]

    expected = [ref for name in ("", *ADAPTERS) for ref in served.reference[name]]
    assert asyncio.run(all_at_once()) == expected
    body = {"prompt": served.prompts, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    for name in ADAPTERS:
        answer = httpx.post(f"{served.http}/v1/completions", json={**body, "model": name}, timeout=60).json()
        assert answer["model"] == name
        assert [c["token_ids"] for c in answer["choices"]] == served.reference[name]
    assert_idle(served.stack.stub)


def test_models_lists_each_adapter_with_its_parent(served: Served) -> None:
    info = served.stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert [(a.name, a.rank) for a in info.lora_adapters] == [("a1", 8), ("a2", 4)]
    cards = httpx.get(f"{served.http}/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(info.model_id, None), ("a1", info.model_id),
                                                       ("a2", info.model_id)]
    assert cards[1]["root"] == str(served.adapters["a1"])


def test_an_unknown_adapter_is_refused_naming_the_field(served: Served) -> None:
    request = token_request(served.prompts[0], 4)
    request.lora = "nope"
    with pytest.raises(grpc.RpcError) as refused:
        list(served.stack.stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora" in refused.value.details() and "nope" in refused.value.details()
    answer = httpx.post(f"{served.http}/v1/completions", json={"prompt": "hi", "model": "nope"}, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    assert_idle(served.stack.stub)


def test_runtime_load_and_unload_while_streams_run(served: Served) -> None:
    stub = served.stack.stub
    # Runs until aborted below: the adapter serves a request all the while, however slow the machine.
    long = token_request(served.prompts[0], 400, ignore_eos=True)
    long.sampling.temperature, long.lora, long.stream_interval, long.request_id = 0.0, "a1", 1, "long"
    running = stub.Generate(long, timeout=120)
    first = next(running)
    metrics = httpx.get(f"{served.http}/metrics", timeout=10).text
    assert 'nanoserve:lora_requests_info{max_lora="2",running_lora_adapters="a1",waiting_lora_adapters=""}' in metrics
    loaded = stub.LoadLoraAdapter(pb.LoadLoraRequest(lora_name="a3", lora_path=str(served.adapters["a2"])), timeout=60)
    assert (loaded.name, loaded.rank) == ("a3", 4)
    # As vLLM's: the unload is answered at once, a1 is refused to new requests, and "long" runs on through it.
    unloaded = stub.UnloadLoraAdapter(pb.UnloadLoraRequest(lora_name="a1"), timeout=60)
    assert unloaded.name == "a1"
    assert "a1" not in [card["id"] for card in httpx.get(f"{served.http}/v1/models", timeout=10).json()["data"]]
    with pytest.raises(grpc.RpcError) as gone:
        list(stub.Generate(long, timeout=30))
    assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    a3 = token_request(served.prompts[1], MAX_NEW_TOKENS, ignore_eos=True)
    a3.sampling.temperature, a3.lora = 0.0, "a3"
    assert [t for r in stub.Generate(a3, timeout=60) for t in r.token_ids] == served.reference["a2"][1]
    metrics = httpx.get(f"{served.http}/metrics", timeout=10).text
    assert 'running_lora_adapters="a1"' in metrics
    assert list(stub.Abort(pb.AbortRequest(request_ids=["long"]), timeout=10).aborted_request_ids) == ["long"]
    responses = [first, *running]
    tokens = [t for r in responses for t in r.token_ids]
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert tokens[:MAX_NEW_TOKENS] == served.reference["a1"][0][: len(tokens)]
    assert_idle(stub)
    # Idle now: a3 unloads, a second unload of it is a 404; over HTTP a1 loads back, and unloads again.
    stub.UnloadLoraAdapter(pb.UnloadLoraRequest(lora_name="a3"), timeout=60)
    refused = httpx.post(f"{served.http}/v1/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert refused.status_code == 404
    with pytest.raises(grpc.RpcError) as gone:
        list(stub.Generate(a3, timeout=30))
    assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = {"lora_name": "a1", "lora_path": str(served.adapters["a1"])}
    deadline = time.monotonic() + 30
    # a1 retires once the executor has dropped "long" (the loop's next turn): until then it cannot load again
    while (loaded := httpx.post(f"{served.http}/v1/load_lora_adapter", json=body, timeout=60)).status_code == 400:
        assert "being unloaded" in loaded.text and time.monotonic() < deadline
        time.sleep(0.05)
    assert loaded.status_code == 200, loaded.text
    again = token_request(served.prompts[0], MAX_NEW_TOKENS, ignore_eos=True)
    again.sampling.temperature, again.lora = 0.0, "a1"
    assert [t for r in stub.Generate(again, timeout=60) for t in r.token_ids] == served.reference["a1"][0]
    assert_idle(stub)


def test_a_misfit_adapter_is_refused_and_the_executor_keeps_serving(served: Served, tmp_path: Path) -> None:
    base = served.adapters["a1"].parent  # any folder without adapter_config.json
    with pytest.raises(grpc.RpcError) as refused:
        served.stack.stub.LoadLoraAdapter(pb.LoadLoraRequest(lora_name="bad", lora_path=str(base)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter_config.json" in refused.value.details()
    request = token_request(served.prompts[1], MAX_NEW_TOKENS, ignore_eos=True)
    request.sampling.temperature, request.lora = 0.0, "a2"
    assert [t for r in served.stack.stub.Generate(request, timeout=60) for t in r.token_ids] == \
        served.reference["a2"][1]
    assert_idle(served.stack.stub)
