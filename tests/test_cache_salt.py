"""vLLM's ``cache_salt``: a salted prompt hits only the prefix-cache blocks computed for requests of the same salt,
on every route that takes one (gRPC, the Python client, chat, batched chat, completions, the Responses API,
Messages, generate); the salt reaches the KV events gateways read; a salt vLLM would refuse is refused naming it."""

from __future__ import annotations

import subprocess
import sys
from array import array
from collections.abc import Iterator

import grpc
import httpx
import pytest
import xxhash

from client.api import Client
from client.errors import NanoserveError
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.kv_zmq import event_fields
from scheduler_svc.api.vllm_engine.info import kv_event
from scheduler_svc.core.block_manager import NO_HASH, chain_hash
from scheduler_svc.core.kv_events import BlockStored
from scheduler_svc.core.sampling import SamplingParams
from tests.http_fixtures import Hosted, hosted
from tests.test_http_request_ids import shadow

PROMPT = list(range(1, 14))  # three full blocks of 4 and one token: 12 tokens can hit


def run_alone(engine, salt: str = "", prompt: list[int] = PROMPT) -> int:
    """Run one request to its end; the prompt tokens it found in the cache."""
    seq = engine.enqueue(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return seq.num_prefix_hit_tokens


def test_a_salted_prompt_hits_only_blocks_computed_under_its_own_salt(make_shadow_engine) -> None:
    engine, _ = make_shadow_engine(num_blocks=64, block_size=4)
    assert run_alone(engine) == 0
    assert run_alone(engine, "tenant-a") == 0, "the unsalted copy is not a salted request's"
    assert run_alone(engine, "tenant-b") == 0, "nor another salt's"
    assert run_alone(engine, "tenant-a") == 12
    assert run_alone(engine, "tenant-b") == 12
    assert run_alone(engine) == 12, "the unsalted copy stays the unsalted requests'"
    assert run_alone(engine, "tenant-a", PROMPT[:8] + [30, 31, 32]) == 8, "a shared prefix hits within the salt"


def test_the_salt_travels_with_the_stored_blocks_and_on_the_first_only_in_vllms_extra_keys(make_shadow_engine):
    engine, _ = make_shadow_engine(num_blocks=64, block_size=4)
    engine.block_manager.listen()
    run_alone(engine, "tenant-a")
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    assert [(e.cache_salt, e.parent_block_hash, len(e.block_hashes)) for e in stored] == [("tenant-a", None, 3)]
    assert event_fields(stored[0])[8] == [["tenant-a"], None, None]
    assert stored[0].block_hashes[0] != chain_hash(PROMPT[:4], NO_HASH), "the salt is in the chain's root"
    lora = BlockStored([1, 2], 9, [0] * 8, 4, lora_id=3, lora_name="a1", cache_salt="s")
    assert event_fields(lora)[8] == [["a1"], ["a1"]], "a chain continued: the salt was in its first block's"
    assert event_fields(BlockStored([1], None, [0] * 4, 4))[8] == [None], "a block without extra keys: nil, as vLLM's"
    smg = kv_event(1, lora).stored
    assert (smg.lora_name, smg.cache_salt) == ("a1", "s"), "the namespace the Shepherd gateway folds into its hashes"
    assert not kv_event(2, stored[0]).stored.HasField("lora_name")


def test_the_hashes_are_keyed_by_a_secret_each_scheduler_process_draws() -> None:
    """Nobody outside the process can compute a block's hash, so no prompt or salt can be crafted to collide with
    another request's prefix (xxh64 unkeyed, or a salt's root, could be inverted)."""
    script = ("from scheduler_svc.core.block_manager import NO_HASH, chain_hash, root_hash\n"
              "from scheduler_svc.core.sequence import Sequence\n"
              "from scheduler_svc.core.sampling import SamplingParams\n"
              "seq = Sequence(0, [1], SamplingParams(), 4, cache_salt='s')\n"
              "print(chain_hash([1, 2, 3, 4], NO_HASH), root_hash(seq))")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs[0][0] != runs[1][0] and runs[0][1] != runs[1][1]
    assert int(runs[0][0]) != xxhash.xxh64_intdigest(array("q", [1, 2, 3, 4]).tobytes())


@pytest.fixture(scope="module")
def api() -> Iterator[Hosted]:
    with hosted(shadow()) as h:
        yield h
        h.assert_idle()


def post(api: Hosted, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, timeout=30)


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


# Each route's body for a prompt of its own, and where its answer counts the cached prompt tokens.
ROUTES = {
    "chat": ("/v1/chat/completions", lambda: chat("A question on the chat route, long enough to fill blocks."),
             lambda a: a["usage"]["prompt_tokens_details"]["cached_tokens"]),
    "batch": ("/v1/chat/completions/batch",
              lambda: {**chat(""), "messages": [[{"role": "user", "content": "The batch's one conversation, long."}]]},
              lambda a: a["usage"]["prompt_tokens_details"]["cached_tokens"]),
    "completions": ("/v1/completions", lambda: {"prompt": "A prompt on the completions route, long enough.",
                                                 "max_tokens": 2},
                    lambda a: a["usage"]["prompt_tokens_details"]["cached_tokens"]),
    "responses": ("/v1/responses", lambda: {"input": "An input on the Responses API, long enough to fill blocks.",
                                            "max_output_tokens": 2, "store": False},
                  lambda a: a["usage"]["input_tokens_details"]["cached_tokens"]),
    "messages": ("/v1/messages", lambda: {"model": "shadow-kv", "max_tokens": 2, "messages": [
        {"role": "user", "content": "A message on the Messages API, long enough to fill its blocks."}]},
                 lambda a: a["usage"]["cache_read_input_tokens"]),
    "generate": ("/inference/v1/generate", lambda: {"token_ids": list(range(40, 70)),
                                                    "sampling_params": {"max_tokens": 2}},
                 lambda a: a["usage"]["prompt_tokens_details"]["cached_tokens"]),
}


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_salts_its_prompt(api: Hosted, route: str) -> None:
    path, body, cached = ROUTES[route]

    def cached_with(salt: str | None) -> int:
        answer = post(api, path, {**body(), **({"cache_salt": salt} if salt else {})})
        assert answer.status_code == 200, answer.text
        return cached(answer.json())

    cached_with(None)  # may find the chat template's first block, which other routes' prompts share
    unsalted = cached_with(None)
    assert unsalted > 0
    assert cached_with(f"{route}-a") == 0, "a salt finds no unsalted block"
    assert cached_with(f"{route}-a") == unsalted, "the same salt finds its blocks"
    assert cached_with(f"{route}-b") == 0, "another salt does not"


@pytest.mark.parametrize("salt", ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129])
def test_a_salt_vllm_refuses_is_refused_naming_it(api: Hosted, salt: str) -> None:
    answer = post(api, "/v1/chat/completions", {**chat("Hi"), "cache_salt": salt})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt", answer.text
    assert post(api, "/v1/chat/completions", {**chat("Hi"), "cache_salt": "x" * 128}).status_code == 200


def test_the_grpc_api_and_the_client_salt_and_refuse_as_the_routes(api: Hosted) -> None:
    with Client(f"127.0.0.1:{api.server.port}", timeout=30) as client:
        def cached_with(salt: str | None) -> int:
            completion = client.generate(token_ids=list(range(80, 100)), max_tokens=2, cache_salt=salt)
            return completion.usage.cached_prompt_tokens

        cached_with("gold")
        assert (cached_with("gold"), cached_with("lead"), cached_with(None)) == (16, 0, 0)
        with pytest.raises(NanoserveError, match="cache_salt"):
            client.generate(token_ids=[1, 2, 3], max_tokens=2, cache_salt="a/b")
    request = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2, 3]), cache_salt="x" * 129)
    with pytest.raises(grpc.RpcError) as refused:
        list(api.stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()


def test_a_render_carries_the_salt_back_to_generate(api: Hosted) -> None:
    body = {**chat("Rendered, then generated under the same salt, long enough."), "cache_salt": "tenant-r"}
    rendered = post(api, "/v1/chat/completions/render", body).json()
    assert rendered["cache_salt"] == "tenant-r"
    post(api, "/inference/v1/generate", rendered)
    again = post(api, "/inference/v1/generate", rendered).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = post(api, "/inference/v1/generate", {**rendered, "cache_salt": "tenant-s"}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "generate salts what it computes"
    assert "cache_salt" not in post(api, "/v1/chat/completions/render", chat("Unsalted")).json()


def test_a_preempted_salted_request_keeps_its_salt(make_shadow_engine) -> None:
    engine, _ = make_shadow_engine(num_blocks=10, block_size=4, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    salted = engine.enqueue(PROMPT, params, cache_salt="tenant-p")
    other = engine.enqueue(list(range(20, 33)), params)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions >= 1 and salted.cache_salt == "tenant-p" and other.is_finished
    assert run_alone(engine, "tenant-p") == 12
    assert run_alone(engine) == 0, "what the salted request computed, before and after its preemption, is its salt's"
