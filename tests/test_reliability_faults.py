"""Faults against the real processes: executor and scheduler as subprocesses over TCP, killed, hung or stopped.

Every stream is checked against the shadow executor's sequential reference; every
test ends with all KV blocks free and the executor holding no request.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service_fixtures import (
    HOST,
    Stack,
    assert_idle,
    executor_argv,
    free_port,
    running_stack,
    spawn,
    stop_process,
    token_request,
    wait_health,
    wait_serving,
)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SHADOW = dict(num_blocks=4096, block_size=4, vocab_size=50, max_model_len=1024, eos_token_ids=0)


def greedy_request(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> pb.GenerateRequest:
    request = token_request(prompt, max_tokens, ignore_eos=ignore_eos)
    request.sampling.temperature = 0
    return request


def expected(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    return reference_generate(prompt, max_tokens, SHADOW["vocab_size"], {SHADOW["eos_token_ids"]}, ignore_eos,
                              max_model_len=SHADOW["max_model_len"])


def workload(n: int, seed: int, min_tokens: int = 100, max_tokens: int = 200) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, 50) for _ in range(rng.randint(1, 40))], rng.randint(min_tokens, max_tokens))
            for _ in range(n)]


def assert_executor_clean(stack: Stack) -> None:
    assert_idle(stack.stub)
    assert stack.executor_reset() == 0, "the executor still held requests the scheduler had finished"


def executor_port(stack: Stack) -> int:
    return int(stack.executor_target.rsplit(":", 1)[1])


async def streams_through(
    stack: Stack, work: list[tuple[list[int], int]], fault: Callable[[], None], ignore_eos: bool = False
) -> list[list[int]]:
    """Start every stream, wait until each has tokens, run ``fault()`` in a thread, then read them to the end."""
    async with grpc.aio.insecure_channel(stack.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Generate(greedy_request(p, m, ignore_eos)) for p, m in work]
        tokens = [list((await call.read()).token_ids) for call in calls]
        await asyncio.to_thread(fault)
        for call, got in zip(calls, tokens, strict=True):
            while (response := await call.read()) != grpc.aio.EOF:
                got.extend(response.token_ids)
        return tokens


def test_executor_killed_mid_generation_and_restarted_every_stream_completes_exactly(tmp_path: Path):
    work = workload(16, seed=3, min_tokens=400, max_tokens=600)
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        restarted = []

        def kill_and_restart() -> None:
            s.executor.kill()
            s.executor.wait()
            assert wait_health(s.target, s.scheduler, (NOT_SERVING,)) == NOT_SERVING
            restarted.append(spawn(executor_argv("shadow", port, SHADOW), tmp_path / "executor-restarted.log"))
            wait_serving(s.target, s.scheduler)

        try:
            tokens = asyncio.run(streams_through(s, work, kill_and_restart, ignore_eos=True))
            assert tokens == [expected(p, m, ignore_eos=True) for p, m in work]
            assert_executor_clean(s)
            assert "is back: 16 requests resume by recompute" in s.logs()
        finally:
            for process in restarted:
                stop_process(process)


def test_a_hung_executor_times_out_and_the_streams_resume_when_it_answers_again(tmp_path: Path):
    work = workload(4, seed=4)
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port, step_timeout=1) as s:

        def hang_for_a_while() -> None:
            s.executor.send_signal(signal.SIGSTOP)
            try:
                assert wait_health(s.target, s.scheduler, (NOT_SERVING,), timeout_s=20) == NOT_SERVING
            finally:
                s.executor.send_signal(signal.SIGCONT)
            wait_serving(s.target, s.scheduler)

        tokens = asyncio.run(streams_through(s, work, hang_for_a_while, ignore_eos=True))
        assert tokens == [expected(p, m, ignore_eos=True) for p, m in work]
        assert "DEADLINE_EXCEEDED" in s.logs()
        assert_executor_clean(s)


def test_a_new_scheduler_on_a_live_executor_starts_clean_after_the_old_one_was_killed(tmp_path: Path):
    work = workload(6, seed=5)
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        # Long enough (no EOS) that every stream is still going when the scheduler dies, however fast it runs.
        responses = [s.stub.Generate(greedy_request(p, 900, ignore_eos=True)) for p, _ in work]
        for r in responses:
            next(r)
        s.scheduler.kill()
        s.scheduler.wait()
        with pytest.raises(grpc.RpcError) as lost:
            list(responses[0])
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        second_port = free_port()
        argv = [sys.executable, "-m", "scheduler_svc", "--host", HOST, "--port", str(second_port),
                "--executor", s.executor_target, "--http-port", "0"]
        second = spawn(argv, tmp_path / "scheduler-2.log")
        try:
            target = f"{HOST}:{second_port}"
            wait_serving(target, second)
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                # The new scheduler numbers its requests from 0 again: a stale request on the executor would clash.
                got = [list(stub.GenerateOnce(greedy_request(p, m)).token_ids) for p, m in work]
                assert got == [expected(p, m) for p, m in work]
                assert_idle(stub)
            assert s.executor_reset() == 0, "stale requests survived on the executor"
        finally:
            stop_process(second)


def test_an_oversized_message_is_refused_and_the_server_carries_on(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port,
                       max_message_bytes=4096) as s:
        big = greedy_request([1] * 5000, 1)
        options = [("grpc.max_send_message_length", 1 << 20)]
        with grpc.insecure_channel(s.target, options=options) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GenerationStub(channel).GenerateOnce(big, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list(s.stub.GenerateOnce(greedy_request([1, 2, 3], 5)).token_ids) == expected([1, 2, 3], 5)
        assert_executor_clean(s)


def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_zero(tmp_path: Path):
    work = workload(4, seed=6)
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        responses = [s.stub.Generate(greedy_request(p, m)) for p, m in work]
        firsts = [list(next(r).token_ids) for r in responses]
        s.scheduler.terminate()
        assert wait_health(s.target, s.scheduler, (NOT_SERVING,), timeout_s=10) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            s.stub.GenerateOnce(greedy_request([1, 2], 3), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        for r, first, (p, m) in zip(responses, firsts, work, strict=True):
            rest = list(r)
            assert rest[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
            assert first + [t for x in rest for t in x.token_ids] == expected(p, m)
        assert s.scheduler.wait(timeout=15) == 0
        assert s.executor_reset() == 0, "the scheduler left requests on the executor"
        assert stop_process(s.executor) == 0


def test_sigterm_aborts_what_the_grace_period_cannot_finish(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port,
                       shutdown_grace=0.5, step_timeout=1) as s:
        responses = s.stub.Generate(greedy_request([1, 2, 3], 1000, ignore_eos=True))
        next(responses)
        s.executor.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            s.scheduler.terminate()
            rest = list(responses)
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert rest[-1].usage.completion_tokens < 1000
            assert time.monotonic() - started < 10
        finally:
            s.executor.send_signal(signal.SIGCONT)
        assert s.scheduler.wait(timeout=15) == 0


def test_an_executor_restarted_with_another_vocabulary_is_refused_until_the_right_one_is_back(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        responses = s.stub.Generate(greedy_request([1, 2, 3], 1000, ignore_eos=True))
        next(responses)
        s.executor.kill()
        s.executor.wait()
        other = spawn(executor_argv("shadow", port, {**SHADOW, "vocab_size": 60}), tmp_path / "executor-other.log")
        try:
            with pytest.raises(grpc.RpcError) as refused:
                list(responses)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "vocab 60" in refused.value.details()
            assert wait_health(s.target, s.scheduler, (NOT_SERVING,)) == NOT_SERVING
        finally:
            stop_process(other)
        right = spawn(executor_argv("shadow", port, SHADOW), tmp_path / "executor-right.log")
        try:
            wait_serving(s.target, s.scheduler)
            assert list(s.stub.GenerateOnce(greedy_request([1, 2, 3], 5)).token_ids) == expected([1, 2, 3], 5)
            assert_executor_clean(s)
            assert s.logs().count("restart the scheduler to switch models") == 1, "logged once, not per attempt"
        finally:
            stop_process(right)


def test_health_follows_an_executor_that_dies_and_returns_while_idle(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as s:
        s.executor.kill()
        s.executor.wait()
        assert wait_health(s.target, s.scheduler, (NOT_SERVING,), timeout_s=10) == NOT_SERVING
        waiting = s.stub.GenerateOnce.future(greedy_request([1, 2, 3], 5))
        restarted = spawn(executor_argv("shadow", port, SHADOW), tmp_path / "executor-restarted.log")
        try:
            wait_serving(s.target, s.scheduler)
            assert list(waiting.result(timeout=30).token_ids) == expected([1, 2, 3], 5)
            assert_executor_clean(s)
        finally:
            stop_process(restarted)
