"""The real Shepherd Model Gateway in front of two nanoserve stacks, as a user would deploy it.

In gRPC mode the gateway speaks vllm.grpc.engine.VllmEngine to each scheduler: it fetches the tokenizer over
GetTokenizer, renders chats and detokenizes itself, routes by the prefix-cache contents it learns from
SubscribeKvEvents, and polls GetLoads. The ``openai`` SDK talks to the gateway; what it reads must be what nanoserve
answers directly (the echo executor repeats each prompt, so every text is known and decodes cleanly). In HTTP mode
the gateway must recognize nanoserve (``/version``) rather than fall back to generic.
The last test kills one scheduler with SIGKILL under load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2 as common

from nanoserve.v1 import generation_pb2 as pb
from tests.gateway_fixtures import TOKENIZER_LOADED, Gateway, running_gateway, smg_binary
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    EOS_ID,
    HOST,
    TOKENIZER_VOCAB_SIZE,
    Stack,
    assert_idle,
    byte_level_tokenizer,
    executor_argv,
    free_port,
    running_stack,
)

MODEL = "echo"
TOKENIZER = byte_level_tokenizer()
BLOCK = 4
KV_STREAM_CONNECTED = "KV event stream connected"
# The gateway's warm-up slices send some requests to a worker with a thin cache whatever it holds: off here, so
# every routing decision is the cache's.
ROUTING_FLAGS = ("--policy", "cache_aware", "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
                 "--load-monitor-interval", "1")


@dataclass
class Worker:
    stack: Stack
    http_url: str


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    smg_binary()  # skip before starting anything when the gateway is not installed
    files = tmp_path_factory.mktemp("tokenizer")
    (files / "tokenizer.json").write_text(TOKENIZER.to_str())
    (files / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    # Room for the kill test's streams with the survivor's KV pressure far under the gateway's overload veto
    # (0.8): a veto from the last load poll steers new requests to the dead scheduler until the next one.
    options = dict(num_blocks=8192, block_size=BLOCK, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=2048,
                   eos_token_ids=EOS_ID, tokenizer_json=files / "tokenizer.json",
                   chat_template=files / "chat_template.jinja")
    with contextlib.ExitStack() as stacks:
        started = []
        for i in range(2):
            port, http_port = free_port(), free_port()
            stack = stacks.enter_context(running_stack(executor_argv("echo", port, options),
                                                       tmp_path_factory.mktemp(f"stack{i}"), executor_port=port,
                                                       http_port=http_port))
            started.append(Worker(stack, f"http://{HOST}:{http_port}"))
        yield started


@pytest.fixture(scope="module")
def gateway(workers: list[Worker], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    urls = [f"grpc://{w.stack.target}" for w in workers]
    with running_gateway(urls, tmp_path_factory.mktemp("smg") / "smg.log", *ROUTING_FLAGS,
                         ready={KV_STREAM_CONNECTED: 2, TOKENIZER_LOADED: 1}) as g:
        yield g


@pytest.fixture
def idle_after(workers: list[Worker]) -> Iterator[None]:
    yield
    for worker in workers:
        if worker.stack.scheduler.poll() is None:
            assert_idle(worker.stack.stub)


def direct(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.http_url}/v1", api_key="none", max_retries=0, timeout=30)


def test_the_gateway_registers_each_scheduler_as_a_vllm_grpc_worker(gateway: Gateway) -> None:
    registered = gateway.workers()
    assert len(registered) == 2
    for worker in registered:
        assert (worker["runtime_type"], worker["connection_mode"], worker["model_id"]) == ("vllm", "grpc", MODEL)
        assert worker["labels"]["page_size"] == str(BLOCK)
    assert "Tokenizer extracted" in gateway.log() or "Successfully loaded tokenizer" in gateway.log()


@pytest.mark.usefixtures("idle_after")
def test_chat_and_completions_through_the_gateway_are_what_nanoserve_answers(gateway: Gateway,
                                                                              workers: list[Worker]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    via, mine = gateway.openai(), direct(workers[0])
    chat = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    expected = mine.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert chat.choices[0].message.content == expected.choices[0].message.content
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    streamed = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    prompt = "The quick brown fox"
    completion = via.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert completion.choices[0].text == mine.completions.create(model=MODEL, prompt=prompt,
                                                                 max_tokens=10).choices[0].text
    text = "".join(c.choices[0].text for c in via.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                                                      stream=True) if c.choices)
    assert text == completion.choices[0].text


@pytest.mark.usefixtures("idle_after")
def test_n_choices_and_stop_strings_through_the_gateway(gateway: Gateway, workers: list[Worker]) -> None:
    via, mine = gateway.openai(), direct(workers[1])
    prompt = "Hello world, the quick brown fox!"
    choices = via.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, seed=11).choices
    expected = mine.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, seed=11).choices
    assert sorted((c.index, c.text) for c in choices) == sorted((c.index, c.text) for c in expected)
    assert [c.index for c in choices] == [0, 1]
    stopped = via.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=["brown"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("Hello world, the quick ", "stop")
    streamed = list(via.chat.completions.create(model=MODEL, max_tokens=30, stop=["brown"], stream=True,
                                                messages=[{"role": "user", "content": prompt}]))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == "user\nHello world, the quick " and streamed[-1].choices[0].finish_reason == "stop"


def document(i: int) -> str:
    """A long prompt prefix of its own (its first block already differs from every other document's)."""
    return f"Document {i}: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 4)


@pytest.mark.usefixtures("idle_after")
def test_cache_aware_routing_follows_the_kv_events_to_the_worker_holding_a_prefix(gateway: Gateway,
                                                                                   workers: list[Worker]) -> None:
    """Each document is cached on one scheduler by a request sent to it directly, past the gateway: only the KV
    events can tell the gateway where it is. A request through the gateway that shares the document goes there, and
    finds it cached; by chance that would happen for all four once in sixteen runs."""
    for i in range(4):
        direct(workers[i % 2]).completions.create(model=MODEL, prompt=document(i) + " First?", max_tokens=1)
    published = {f"grpc://{w.stack.target}": stored_through(w, [document(i) + " First?" for i in (n, n + 2)])
                 for n, w in enumerate(workers)}
    deadline = time.monotonic() + 30
    while any((applied := gateway_stored(gateway)).get(url, 0) < n for url, n in published.items()):
        assert time.monotonic() < deadline, f"the gateway applied {applied} stored blocks of {published}"
        time.sleep(0.05)
    via = gateway.openai()
    for i in range(4):
        answer = via.completions.create(model=MODEL, prompt=document(i) + " Second?", max_tokens=1)
        prompt_tokens = direct(workers[i % 2]).completions.create(model=MODEL, prompt=document(i),
                                                                  max_tokens=1).usage.prompt_tokens
        assert answer.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - BLOCK, f"document {i}"


def stored_through(worker: Worker, prompts: list[str]) -> int:
    """The blocks ``worker``'s KV events stored, from its first batch through the one that stores the last of
    ``prompts`` (each a chain of its own), read back from the batches it keeps as a resuming gateway would."""
    firsts = {tuple(TOKENIZER.encode(prompt).ids[:BLOCK]) for prompt in prompts}
    with grpc.insecure_channel(worker.stack.target) as channel:
        batches = vllm_grpc.VllmEngineStub(channel).SubscribeKvEvents(
            common.SubscribeKvEventsRequest(start_sequence_number=1), timeout=30)
        total = 0
        for batch in batches:
            for event in batch.events:
                if event.WhichOneof("data") == "stored":
                    total += len(event.stored.blocks)
                    firsts.discard(tuple(event.stored.blocks[0].token_ids))
            if not firsts:
                batches.cancel()
                return total
    raise AssertionError(f"{worker.stack.target}'s KV events ended before storing every prompt")


def gateway_stored(gateway: Gateway) -> dict[str, float]:
    """The blocks the gateway applied from each worker's stored events, by the worker's URL."""
    text = httpx.get(f"{gateway.metrics_url}/metrics", timeout=10).text
    return {sample.labels["worker"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "smg_kv_event_blocks_total" and sample.labels.get("op") == "stored"}


def loads(gateway: Gateway) -> dict[str, dict]:
    """The GetLoads answer of each worker that answered the gateway's poll just now, by its URL."""
    answer = httpx.get(f"{gateway.url}/get_loads", timeout=10).json()
    return {entry["worker"]: entry for entry in answer["loads"]}


@pytest.mark.usefixtures("idle_after")
def test_get_loads_follows_the_queue(gateway: Gateway, workers: list[Worker]) -> None:
    """With its executor stopped (SIGSTOP), requests sent to a scheduler pile up, and GetLoads says so at once."""
    held = workers[0]
    executor = held.stack.executor
    os.kill(executor.pid, signal.SIGSTOP)
    pool = ThreadPoolExecutor(3)
    try:
        pending = [pool.submit(direct(held).completions.create, model=MODEL, prompt=f"Queued {i}", max_tokens=3)
                   for i in range(3)]
        deadline = time.monotonic() + 10
        while (waiting := waiting_requests(loads(gateway), held)) < 3:
            assert time.monotonic() < deadline, f"GetLoads never showed the queue: {loads(gateway)}"
            time.sleep(0.05)
    finally:
        os.kill(executor.pid, signal.SIGCONT)
    assert waiting == 3 and [p.result(timeout=30).usage.completion_tokens for p in pending] == [3, 3, 3]
    deadline = time.monotonic() + 10
    while waiting_requests(loads(gateway), held):
        assert time.monotonic() < deadline, f"GetLoads still shows a queue: {loads(gateway)}"
        time.sleep(0.05)
    pool.shutdown()


def waiting_requests(by_url: dict[str, dict], worker: Worker) -> int:
    return by_url.get(f"grpc://{worker.stack.target}", {}).get("num_waiting_reqs", 0)


def test_in_http_mode_the_gateway_recognizes_nanoserve(workers: list[Worker], tmp_path: Path) -> None:
    with running_gateway([w.http_url for w in workers], tmp_path / "smg-http.log") as gateway:
        assert [w["runtime_type"] for w in gateway.workers()] == ["vllm", "vllm"]
        messages = [{"role": "user", "content": "Hello world"}]
        answer = gateway.openai().chat.completions.create(model=MODEL, max_tokens=5, messages=messages)
        expected = direct(workers[0]).chat.completions.create(model=MODEL, max_tokens=5, messages=messages)
        assert answer.choices[0].message.content == expected.choices[0].message.content
        log = gateway.log()
    assert "generic" not in log and "Could not identify backend" not in log


def test_kill_9_of_a_scheduler_mid_load_sends_new_requests_to_the_other_and_nothing_hangs(
        gateway: Gateway, workers: list[Worker]) -> None:
    """Last: it leaves one scheduler dead. Streams in flight on it end (an error, not a hang); new requests are
    served by the survivor."""
    via = gateway.openai()
    started = threading.Barrier(9)

    def long_stream(i: int) -> str:
        stream = via.completions.create(model=MODEL, prompt=f"Long stream {i} " + document(i), max_tokens=1500,
                                        stream=True, extra_body={"ignore_eos": True})
        try:
            chunks = iter(stream)
            next(chunks)
            started.wait(30)
            for _ in chunks:
                pass
            return "completed"
        except (openai.APIError, httpx.HTTPError) as e:
            return f"failed: {type(e).__name__}"

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(long_stream, i) for i in range(8)]
        started.wait(30)
        held = [stats.num_running + stats.num_waiting
                for stats in (w.stack.stub.GetStats(pb.GetStatsRequest(), timeout=5) for w in workers)]
        victim = 0 if held[0] >= held[1] else 1
        os.kill(workers[victim].stack.scheduler.pid, signal.SIGKILL)
        outcomes = [s.result(timeout=60) for s in streams]
    assert sorted(outcomes).count("completed") == held[1 - victim], outcomes
    assert all(o == "completed" or o.startswith("failed") for o in outcomes)
    served = [via.completions.create(model=MODEL, prompt=f"After the kill {i}", max_tokens=4) for i in range(6)]
    assert all(answer.usage.completion_tokens == 4 for answer in served)
    assert_idle(workers[1 - victim].stack.stub)
