"""The whole stack as users run it: an executor process and a scheduler process over TCP.

Token prompts against the shadow-KV executor (and the real one when it is
available); every test ends with every KV block free and the executor holding
no request.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from executor_svc.shadow import ShadowExecutor
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import SchedulerConfig
from scheduler_svc.sequence import FinishReason
from tests.service_fixtures import (
    REAL_EXECUTOR_MISSING,
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


@pytest.fixture(
    scope="module",
    params=[
        "shadow",
        pytest.param(
            "real",
            marks=pytest.mark.skipif(
                REAL_EXECUTOR_MISSING, reason="the torch executor (python -m executor_svc) has not landed yet"
            ),
        ),
    ],
)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log_dir = tmp_path_factory.mktemp(f"stack-{request.param}")
    with running_stack(executor_argv("shadow", port, SHADOW), log_dir, executor_port=port, **SCHEDULER) as s:
        yield s


def in_process_reference(prompts: list[list[int]], params: list[SamplingParams]):
    """What the in-process Engine returns for the same requests on the same executor configuration."""
    executor = ShadowExecutor(
        SHADOW["num_blocks"], SHADOW["block_size"], SHADOW["vocab_size"], (SHADOW["eos_token_ids"],),
        SHADOW["max_model_len"],
    )
    engine = Engine(executor, SchedulerConfig(**SCHEDULER))
    return engine.generate(prompts, params)


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


def test_32_concurrent_streams_get_exactly_the_in_process_engine_tokens(stack: Stack):
    prompts, max_tokens = random_workload(32, seed=1)
    expected = in_process_reference(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])

    async def run() -> list:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            requests = []
            for p, m in zip(prompts, max_tokens, strict=True):
                request = token_request(p, m)
                request.sampling.temperature = 0
                requests.append(request)
            return await asyncio.gather(*(stream(stub, r) for r in requests))

    results = asyncio.run(run())
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.token_ids == want.token_ids, f"request {i}"
        assert got.finish_reason == FINISH[want.finish_reason], f"request {i}"
        assert got.usage.prompt_tokens == len(prompts[i])
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.cached_prompt_tokens % SHADOW["block_size"] == 0
    stats = assert_idle(stack.stub)
    assert stats.num_preemptions > 0, "the workload was meant to overflow the KV cache"
    assert stack.executor_reset() == 0


def test_cancel_mid_stream_frees_blocks_and_leaves_the_others_intact(stack: Stack):
    prompts, max_tokens = random_workload(6, seed=2)
    expected = in_process_reference(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    before = stack.stub.GetStats(pb.GetStatsRequest())

    async def run():
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            long_call = stub.Generate(token_request([7, 8, 9], max_tokens=300, ignore_eos=True))
            requests = [token_request(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
            others = [asyncio.ensure_future(stream(stub, r)) for r in requests]
            received = 0
            async for _ in long_call:
                received += 1
                if received == 3:
                    long_call.cancel()
                    break
            during = await stub.GetStats(pb.GetStatsRequest())
            return await asyncio.gather(*others), during

    results, during = asyncio.run(run())
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    stats = assert_idle(stack.stub)
    assert stats.num_aborted == before.num_aborted + 1
    assert stats.num_finished_length + stats.num_finished_stop == (
        before.num_finished_length + before.num_finished_stop + len(prompts)
    )
    assert during.num_blocks == stats.num_blocks
    assert_executor_clean(stack)


def test_a_deadline_aborts_the_request_and_frees_its_blocks(stack: Stack):
    before = stack.stub.GetStats(pb.GetStatsRequest())
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Generate(token_request([1, 2, 3], max_tokens=350, ignore_eos=True), timeout=0.05))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = assert_idle(stack.stub)
    assert stats.num_aborted == before.num_aborted + 1
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
        ("more KV blocks than exist", token_request([1] * 8, 450, ignore_eos=True), "KV blocks"),
    ]


BAD = bad_requests(SHADOW["max_model_len"], SHADOW["vocab_size"])


def test_bad_inputs_are_refused_while_a_good_stream_completes(stack: Stack):
    expected = in_process_reference([[5, 6, 7]], [SamplingParams(max_tokens=300, ignore_eos=True)])[0]

    async def run():
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            good = asyncio.ensure_future(stream(stub, token_request([5, 6, 7], 300, ignore_eos=True)))
            errors = {}
            for case, request, _ in BAD:
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
        needle = next(n for c, _, n in BAD if c == case)
        assert error is not None, f"{method} accepted {case}"
        code, details = error
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method}, {case}: {code} {details}"
        assert needle in details, f"{method}, {case}: {details!r} does not mention {needle!r}"
    assert_executor_clean(stack)


def test_generate_once_returns_the_whole_completion_and_usage(stack: Stack):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = in_process_reference([prompt], [SamplingParams(max_tokens=20, ignore_eos=True)])[0]
    response = stack.stub.GenerateOnce(token_request(prompt, 20, ignore_eos=True))
    assert list(response.token_ids) == expected.token_ids
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (8, 20)
    again = stack.stub.GenerateOnce(token_request(prompt, 20, ignore_eos=True))
    assert list(again.token_ids) == expected.token_ids
    assert again.usage.cached_prompt_tokens == 4, "the prompt's first full block is a prefix-cache hit"
    assert_executor_clean(stack)


def test_request_ids_are_echoed_or_assigned(stack: Stack):
    request = token_request([1, 2, 3], 3)
    request.request_id = "mine-42"
    assert {r.request_id for r in stack.stub.Generate(request)} == {"mine-42"}
    assigned = stack.stub.GenerateOnce(token_request([1, 2, 3], 3)).request_id
    assert len(assigned) == 32
    assert_executor_clean(stack)


def test_model_info_and_stats(stack: Stack):
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_blocks, info.block_size, info.vocab_size) == (96, 4, 50)
    assert info.max_model_len == 512 and list(info.eos_token_ids) == [0]
    assert not info.has_tokenizer and not info.has_chat_template
    stats = stack.stub.GetStats(pb.GetStatsRequest())
    assert stats.num_blocks == 96


def test_scheduler_waits_for_a_late_executor(tmp_path: Path):
    port = free_port()
    with running_stack(None, tmp_path, executor_port=port) as s:
        assert wait_health(s.target, s.scheduler, (NOT_SERVING,)) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            s.stub.GenerateOnce(token_request([1, 2], 2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connecting to the executor" in e.value.details()
        while "not ready" not in s.logs():
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


def test_a_dead_executor_fails_the_stream_with_unavailable_and_a_restarted_one_serves_again(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        responses = s.stub.Generate(token_request([1, 2, 3], 300, ignore_eos=True))
        next(responses)
        s.executor.kill()
        s.executor.wait()
        with pytest.raises(grpc.RpcError) as e:
            list(responses)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the executor failed a step" in e.value.details()
        assert_idle(s.stub)
        restarted = spawn(executor_argv("shadow", port, SHADOW), tmp_path / "executor-restarted.log")
        try:
            response = generate_once_when_available(s.stub, token_request([1, 2, 3], 5, ignore_eos=True))
            reference = in_process_reference([[1, 2, 3]], [SamplingParams(max_tokens=5, ignore_eos=True)])[0]
            assert list(response.token_ids) == reference.token_ids
            assert_executor_clean(s)
        finally:
            stop_process(restarted)


def generate_once_when_available(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout_s: float = 30
) -> pb.GenerateResponse:
    """Retry UNAVAILABLE, as a client does while an executor comes back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return stub.GenerateOnce(request)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
            time.sleep(0.2)


def test_sigterm_aborts_streams_and_exits_cleanly(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        responses = s.stub.Generate(token_request([1, 2, 3], 350, ignore_eos=True))
        next(responses)
        s.scheduler.terminate()
        rest = list(responses)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert rest[-1].usage.completion_tokens < 350
        assert s.scheduler.wait(timeout=15) == 0
        assert s.executor_reset() == 0, "the scheduler left requests on the executor"
