"""The whole stack as users run it: an executor process and a scheduler process over TCP.

Token prompts against the shadow-KV executor and the torch executor (a tiny
random-weight llama); every test ends with every KV block free and the executor
holding no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from executor_svc.fakes.shadow import ShadowExecutor
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.engine.engine import Engine, FinishedRequest
from tests.service_fixtures import (
    HOST,
    START_TIMEOUT_S,
    Stack,
    assert_idle,
    executor_argv,
    free_port,
    running_stack,
    spawn,
    stop_process,
    stream,
    token_request,
    wait_health,
    wait_serving,
)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SHADOW = dict(num_blocks=96, block_size=4, vocab_size=50, max_model_len=512, eos_token_ids=0)
SCHEDULER = dict(max_num_seqs=16, max_num_batched_tokens=64)
FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
# The tiny random-weight llama of tests/model_fixtures.py: 2 layers x 2 KV heads x 16 dims, float32, so a
# 4-token block takes 2 KB and this budget gives the shadow stack's 96 blocks.
REAL_KV_CACHE_BYTES = 96 * 4 * 2 * 2 * 2 * 16 * 4


@dataclass
class Backend:
    """An executor the suite runs against, and what the in-process Engine returns on the same one."""

    name: str
    argv: Callable[[int], list[str]]
    reference: Callable[[list[list[int]], list[SamplingParams]], list[FinishedRequest]]
    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_id: int


def shadow_reference(prompts: list[list[int]], params: list[SamplingParams]) -> list[FinishedRequest]:
    executor = ShadowExecutor(
        SHADOW["num_blocks"], SHADOW["block_size"], SHADOW["vocab_size"], (SHADOW["eos_token_ids"],),
        SHADOW["max_model_len"],
    )
    return Engine(executor, SchedulerConfig(**SCHEDULER)).generate(prompts, params)


SHADOW_BACKEND = Backend(
    "shadow", lambda port: executor_argv("shadow", port, SHADOW), shadow_reference,
    SHADOW["num_blocks"], SHADOW["block_size"], SHADOW["vocab_size"], SHADOW["max_model_len"], SHADOW["eos_token_ids"],
)


@contextlib.contextmanager
def real_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """The torch executor on the tiny random-weight llama; the reference runs the same model in this process."""
    from executor_svc.runtime.config import ExecutorOptions
    from executor_svc.runtime.model_executor import ModelExecutor
    from tests.model_fixtures import TINY_VOCAB, save_tiny_model

    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama") / "llama")
    flags = dict(model=folder, dtype="float32", block_size=4, kv_cache_memory=REAL_KV_CACHE_BYTES, max_model_len=512,
                 threads=1)
    executor = ModelExecutor(ExecutorOptions(**{**flags, "model": str(folder)}))

    def argv(port: int) -> list[str]:
        command = [sys.executable, "-m", "executor_svc", "--host", HOST, "--port", str(port), "--device", "cpu"]
        return command + [arg for key, value in flags.items() for arg in (f"--{key.replace('_', '-')}", str(value))]

    def reference(prompts: list[list[int]], params: list[SamplingParams]) -> list[FinishedRequest]:
        return Engine(executor, SchedulerConfig(**SCHEDULER)).generate(prompts, params)

    info = executor.get_info()
    assert (info.num_blocks, info.block_size, info.vocab_size) == (96, 4, TINY_VOCAB)
    try:
        yield Backend("real", argv, reference, 96, 4, TINY_VOCAB, 512, info.eos_token_ids[0])
    finally:
        executor.close()


@pytest.fixture(scope="module", params=["shadow", "real"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    if request.param == "shadow":
        yield SHADOW_BACKEND
        return
    with real_backend(tmp_path_factory) as real:
        yield real


@pytest.fixture(scope="module")
def stack(backend: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port = free_port()
    log_dir = tmp_path_factory.mktemp(f"stack-{backend.name}")
    with running_stack(backend.argv(port), log_dir, executor_port=port, **SCHEDULER) as s:
        yield s


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def greedy_request(token_ids: list[int], max_tokens: int | None = None, **stopping: object) -> pb.GenerateRequest:
    request = token_request(token_ids, max_tokens, **stopping)
    request.sampling.temperature = 0
    return request


def random_workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Mixed prompt and output lengths; some prompts share a prefix, so the prefix cache is hit."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    prompts, max_tokens = [], []
    for i in range(n):
        own = [rng.randrange(1, 50) for _ in range(rng.randint(1, 60))]
        prompts.append(shared + own if i % 3 == 0 else own)
        max_tokens.append(rng.randint(1, 80))
    return prompts, max_tokens


def assert_executor_clean(stack: Stack) -> None:
    assert_idle(stack.stub)
    assert stack.executor_reset() == 0, "the executor still held requests the scheduler had finished"


@pytest.fixture(scope="module")
def sync_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shadow stack with overlap turned off: one unary Step at a time (``stack`` keeps a step in flight,
    the default)."""
    port = free_port()
    log_dir = tmp_path_factory.mktemp("stack-sync")
    with running_stack(SHADOW_BACKEND.argv(port), log_dir, executor_port=port, overlap="off", **SCHEDULER) as s:
        yield s


@pytest.fixture(scope="module")
def multi_step_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shadow stack planning 6 decode steps at a time, with overlap."""
    port = free_port()
    log_dir = tmp_path_factory.mktemp("stack-multi-step")
    with running_stack(SHADOW_BACKEND.argv(port), log_dir, executor_port=port, overlap="true",
                       num_scheduler_steps=6, **SCHEDULER) as s:
        yield s


def test_32_concurrent_streams_get_exactly_the_in_process_engine_tokens(stack: Stack, backend: Backend):
    check_32_concurrent_streams(stack, backend)


def test_32_concurrent_streams_without_overlap_get_the_same_tokens(sync_stack: Stack):
    check_32_concurrent_streams(sync_stack, SHADOW_BACKEND)


def test_32_concurrent_streams_with_multi_step_decode_get_the_same_tokens(multi_step_stack: Stack):
    check_32_concurrent_streams(multi_step_stack, SHADOW_BACKEND)


def check_32_concurrent_streams(stack: Stack, backend: Backend) -> None:
    prompts, max_tokens = random_workload(32, seed=1)
    expected = backend.reference(prompts, [greedy(m) for m in max_tokens])
    before = stack.stub.GetStats(pb.GetStatsRequest())

    async def run() -> list:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            requests = [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
            return await asyncio.gather(*(stream(stub, r) for r in requests))

    results = asyncio.run(run())
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.token_ids == want.token_ids, f"request {i}"
        assert got.finish_reason == FINISH[want.finish_reason], f"request {i}"
        assert got.usage.prompt_tokens == len(prompts[i])
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.cached_prompt_tokens % backend.block_size == 0
    stats = assert_idle(stack.stub)
    assert stats.num_preemptions > 0, "the workload was meant to overflow the KV cache"
    assert stats.num_generation_tokens - before.num_generation_tokens == sum(len(r.token_ids) for r in results)
    assert stack.executor_reset() == 0


def test_cancel_mid_stream_frees_blocks_and_leaves_the_others_intact(stack: Stack, backend: Backend):
    prompts, max_tokens = random_workload(6, seed=2)
    expected = backend.reference(prompts, [greedy(m) for m in max_tokens])
    before = stack.stub.GetStats(pb.GetStatsRequest())

    async def run():
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            long_call = stub.Generate(token_request([7, 8, 9], max_tokens=370, ignore_eos=True))
            requests = [greedy_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
            others = [asyncio.ensure_future(stream(stub, r)) for r in requests]
            received = 0
            async for _ in long_call:
                received += 1
                if received == 3:
                    long_call.cancel()
                    break
            return await asyncio.gather(*others)

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    stats = assert_idle(stack.stub)
    assert stats.num_aborted == before.num_aborted + 1
    assert stats.num_finished_length + stats.num_finished_stop == (
        before.num_finished_length + before.num_finished_stop + len(prompts)
    )
    assert_executor_clean(stack)


def bad_requests(max_model_len: int, vocab_size: int) -> list[tuple[str, pb.GenerateRequest, str]]:
    """(case, request, what the message must name) for every input a token-only server refuses."""
    def sampled(**kwargs) -> pb.GenerateRequest:
        return pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2]), sampling=pb.SamplingOptions(**kwargs))

    return [
        ("no prompt", pb.GenerateRequest(), "prompt"),
        ("empty token prompt", token_request([]), "tokens.token_ids"),
        ("empty text prompt", pb.GenerateRequest(text=""), "text"),
        ("text without tokenizer", pb.GenerateRequest(text="hello"), "tokenizer"),
        ("chat without tokenizer", pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user")])),
         "tokenizer"),
        ("prompt too long", token_request([1] * max_model_len), f"{max_model_len}"),
        ("prompt + max_tokens too long", token_request([1] * 10, max_model_len), f"{10 + max_model_len}"),
        ("max_tokens 0", token_request([1, 2], 0), "stopping.max_tokens"),
        ("negative temperature", sampled(temperature=-0.5), "sampling.temperature"),
        ("NaN temperature", sampled(temperature=math.nan), "sampling.temperature"),
        ("top_p 0", sampled(top_p=0), "sampling.top_p"),
        ("top_p above 1", sampled(top_p=1.5), "sampling.top_p"),
        ("min_p above 1", sampled(min_p=1.5), "sampling.min_p"),
        ("min_p negative", sampled(min_p=-0.1), "sampling.min_p"),
        ("logprobs above 20", sampled(logprobs=21), "sampling.logprobs"),
        ("token id out of vocabulary", token_request([1, vocab_size]), f"token id {vocab_size}"),
        ("stop strings without tokenizer", token_request([1, 2], stop=["x"]), "stopping.stop"),
        ("more KV blocks than exist", token_request([1] * 8, 450, ignore_eos=True), "stopping.max_tokens: seq"),
        ("n 0", sampled(n=0), "sampling.n"),
        ("n 17", sampled(n=17), "sampling.n"),
        ("repetition_penalty 0", sampled(repetition_penalty=0), "sampling.repetition_penalty"),
        ("presence_penalty beyond 2", sampled(presence_penalty=2.5), "sampling.presence_penalty"),
        ("frequency_penalty below -2", sampled(frequency_penalty=-2.5), "sampling.frequency_penalty"),
        ("logit_bias beyond 100", sampled(logit_bias={3: 100.5}), "sampling.logit_bias"),
        ("logit_bias id out of vocabulary", sampled(logit_bias={vocab_size: 1.0}), "sampling.logit_bias"),
        ("min_tokens above max_tokens", token_request([1, 2], 4, min_tokens=5), "stopping.min_tokens"),
        ("stop token id out of vocabulary", token_request([1, 2], stop_token_ids=[vocab_size]),
         "stopping.stop_token_ids"),
        ("truncate_prompt_tokens 0", pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2]),
                                                        truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        ("prompt_logprobs above 20", pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2]), prompt_logprobs=21),
         "prompt_logprobs"),
        ("structured output without tokenizer", pb.GenerateRequest(
            tokens=pb.TokenPrompt(token_ids=[1, 2]), structured_output=pb.StructuredOutput(regex="a+")),
         "structured_output"),
    ]


def test_bad_inputs_are_refused_while_a_good_stream_completes(stack: Stack, backend: Backend):
    expected = backend.reference([[5, 6, 7]], [greedy(300, ignore_eos=True)])[0]
    bad = bad_requests(backend.max_model_len, backend.vocab_size)

    async def run():
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            good = asyncio.ensure_future(stream(stub, greedy_request([5, 6, 7], 300, ignore_eos=True)))
            errors = {}
            for case, request, _ in bad:
                for method in ("Generate", "GenerateOnce"):
                    try:
                        if method == "Generate":
                            [r async for r in stub.Generate(request)]
                        else:
                            await stub.GenerateOnce(request)
                        errors[case, method] = None
                    except grpc.aio.AioRpcError as e:
                        errors[case, method] = (e.code(), e.details())
            return await good, errors

    good, errors = asyncio.run(run())
    assert good.token_ids == expected.token_ids
    assert good.finish_reason == pb.FINISH_REASON_LENGTH
    for (case, method), error in errors.items():
        needle = next(n for c, _, n in bad if c == case)
        assert error is not None, f"{method} accepted {case}"
        code, details = error
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method}, {case}: {code} {details}"
        assert needle in details, f"{method}, {case}: {details!r} does not mention {needle!r}"
    assert_executor_clean(stack)


def test_generate_once_returns_the_whole_completion_and_usage(stack: Stack, backend: Backend):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = backend.reference([prompt], [greedy(20, ignore_eos=True)])[0]
    response = stack.stub.GenerateOnce(greedy_request(prompt, 20, ignore_eos=True))
    assert list(response.token_ids) == expected.token_ids
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (8, 20)
    again = stack.stub.GenerateOnce(greedy_request(prompt, 20, ignore_eos=True))
    assert list(again.token_ids) == expected.token_ids
    assert again.usage.cached_prompt_tokens == 4, "the prompt's first full block is a prefix-cache hit"
    assert_executor_clean(stack)


def test_logprobs_follow_each_token_when_the_executor_computes_them(stack: Stack, backend: Backend):
    prompt = [4, 8, 15, 16, 23, 42]
    plain = stack.stub.GenerateOnce(greedy_request(prompt, 6, ignore_eos=True))
    request = greedy_request(prompt, 6, ignore_eos=True)
    request.sampling.logprobs = 2
    responses = list(stack.stub.Generate(request))
    tokens = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert tokens == list(plain.token_ids), "asking for logprobs changed the tokens"
    if backend.name == "shadow":
        assert logprobs == [], "the shadow executor computes no logprobs, so none are sent"
    else:
        assert [lp.token_id for lp in logprobs] == tokens
        for lp in logprobs:
            assert len(lp.top) == 2 and lp.top[0].token_id == lp.token_id, "greedy takes the most likely token"
            assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.top[0].logprob >= lp.top[1].logprob
    assert_executor_clean(stack)


def test_request_ids_are_echoed_or_assigned(stack: Stack):
    request = token_request([1, 2, 3], 3)
    request.request_id = "mine-42"
    assert {r.request_id for r in stack.stub.Generate(request)} == {"mine-42"}
    assigned = stack.stub.GenerateOnce(token_request([1, 2, 3], 3)).request_id
    assert len(assigned) == 32
    assert_executor_clean(stack)


def test_model_info_and_stats(stack: Stack, backend: Backend):
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_blocks, info.block_size, info.vocab_size) == (backend.num_blocks, 4, backend.vocab_size)
    assert info.max_model_len == backend.max_model_len and info.eos_token_ids[0] == backend.eos_token_id
    assert not info.has_tokenizer and not info.has_chat_template
    stats = stack.stub.GetStats(pb.GetStatsRequest())
    assert stats.num_blocks == backend.num_blocks


def test_scheduler_waits_for_a_late_executor(tmp_path: Path):
    port = free_port()
    with running_stack(None, tmp_path, executor_port=port) as s:
        assert wait_health(s.target, s.scheduler, (NOT_SERVING,)) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            s.stub.GenerateOnce(token_request([1, 2], 2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connecting to the executor" in e.value.details()
        deadline = time.monotonic() + START_TIMEOUT_S
        while "not ready" not in s.logs():
            assert s.scheduler.poll() is None, f"the scheduler exited:\n{s.logs()[-3000:]}"
            assert time.monotonic() < deadline, f"no 'not ready' in the scheduler's log:\n{s.logs()[-3000:]}"
            time.sleep(0.05)
        executor = spawn(executor_argv("shadow", port, SHADOW), tmp_path / "late-executor.log")
        try:
            wait_serving(s.target, s.scheduler)
            assert len(s.stub.GenerateOnce(token_request([1, 2], 2, ignore_eos=True)).token_ids) == 2
            assert_idle(s.stub)
        finally:
            stop_process(executor)


def test_reflection_lists_the_services(stack: Stack):
    services = ProtoReflectionDescriptorDatabase(stack.channel).get_services()
    assert {"nanoserve.v1.Generation", "grpc.health.v1.Health"} <= set(services)


def test_sigterm_without_grace_aborts_streams_and_exits_cleanly(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port, shutdown_grace=0) as s:
        responses = s.stub.Generate(token_request([1, 2, 3], 380, ignore_eos=True))
        next(responses)
        s.scheduler.terminate()
        rest = list(responses)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert rest[-1].usage.completion_tokens < 380
        assert s.scheduler.wait(timeout=15) == 0
        assert s.executor_reset() == 0, "the scheduler left requests on the executor"
