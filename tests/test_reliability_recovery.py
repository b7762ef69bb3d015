"""Executor outages behind an in-process scheduler: streams pause and carry on, never fail, unless they must.

The executor here is a shadow-KV executor the test can take down, restart (a new
instance with an empty KV cache, maybe another size or vocabulary) or make refuse
plans; every stream's tokens are checked against the sequential reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.executor import Executor
from common.step import ExecutorInfo, LoraAdapterInfo, StepPlan, StepResult
from executor_svc.core.request_table import PlanError
from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import (
    HOST,
    InProcess,
    assert_idle_async,
    in_process_scheduler,
    rest_of,
    stream,
    token_request,
)

VOCAB = 50
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FlakyExecutor(Executor):
    """A shadow executor that can go down (every call fails), restart (a fresh instance) or refuse plans."""

    def __init__(self, **shadow: object) -> None:
        self.shadow = {"num_blocks": 64, "block_size": 4, "vocab_size": VOCAB, **shadow}
        self.inner = ShadowExecutor(**self.shadow)
        self.down = False
        self.refuse_plans = False
        # Refuse every decode (a prefill, a recovery's recompute too, still runs).
        self.refuse_decodes = False
        # Seconds each step takes, as a real forward pass would.
        self.step_delay_s = 0.0

    def restart(self, **changes: object) -> None:
        """Come back as a new process would: new instance id, empty KV cache, perhaps another shape."""
        self.shadow.update(changes)
        self.inner = ShadowExecutor(**self.shadow)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("injected: executor down")

    def get_info(self) -> ExecutorInfo:
        self._check()
        return self.inner.get_info()

    def reset(self) -> int:
        self._check()
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self._check()
        if self.refuse_plans and (plan.new_requests or plan.cached_requests.request_ids):
            raise PlanError("FAILED_PRECONDITION", "injected: plan refused")
        if self.refuse_decodes and not plan.is_prefill:
            raise PlanError("FAILED_PRECONDITION", "injected: decode refused")
        time.sleep(self.step_delay_s)
        return self.inner.step(plan)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_generate(prompt, max_tokens, VOCAB, {0}, ignore_eos=True)


async def health(s: InProcess) -> int:
    async with grpc.aio.insecure_channel(f"{HOST}:{s.server.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def wait_health(s: InProcess, status: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while await health(s) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        await asyncio.sleep(0.02)


async def started_streams(s: InProcess, prompts: list[list[int]], max_tokens: int) -> list[grpc.aio.UnaryStreamCall]:
    """Streams that have each received their first response."""
    calls = [s.stub.Generate(token_request(p, max_tokens, ignore_eos=True)) for p in prompts]
    firsts = [await call.read() for call in calls]
    assert all(first.token_ids for first in firsts)
    return calls


async def tokens_of(call: grpc.aio.UnaryStreamCall, first: list[int]) -> list[int]:
    """``first`` and the rest of the stream's tokens (read with ``read``, as the stream was started with it)."""
    tokens = list(first)
    while (response := await call.read()) != grpc.aio.EOF:
        tokens.extend(response.token_ids)
    return tokens


@contextlib.asynccontextmanager
async def scheduler(executor: FlakyExecutor, **config: object) -> AsyncIterator[InProcess]:
    async with in_process_scheduler(executor, **config) as s:
        yield s
        await assert_idle_async(s.stub)
        assert len(executor.inner.table) == 0, "the executor still holds requests"


PROMPTS = [[i, 2, 3, i + 4] for i in range(1, 7)]


def test_streams_pause_through_an_outage_and_finish_with_the_undisturbed_tokens():
    executor = FlakyExecutor(num_blocks=256)
    executor.step_delay_s = 0.002

    async def run():
        async with scheduler(executor) as s:
            calls = [s.stub.Generate(token_request(p, 40, ignore_eos=True)) for p in PROMPTS]
            firsts = [list((await call.read()).token_ids) for call in calls]
            executor.down = True
            await wait_health(s, NOT_SERVING)
            # Arriving during the outage: it waits rather than fails.
            late = asyncio.ensure_future(stream(s.stub, token_request([7, 7, 7], 10, ignore_eos=True)))
            await asyncio.sleep(0.5)
            assert not late.done() and not any(call.done() for call in calls)
            executor.restart()
            await wait_health(s, SERVING)
            return [await tokens_of(c, f) for c, f in zip(calls, firsts, strict=True)], await late

    tokens, late = asyncio.run(run())
    assert tokens == [expected_tokens(p, 40) for p in PROMPTS]
    assert late.token_ids == expected_tokens([7, 7, 7], 10)


def test_requests_too_large_for_the_restarted_executor_fail_with_failed_precondition():
    executor = FlakyExecutor(num_blocks=64)
    executor.step_delay_s = 0.05

    async def run():
        async with scheduler(executor) as s:
            small, large = await started_streams(s, [[1, 2, 3]], 8) + await started_streams(s, [list(range(1, 40))], 8)
            executor.down = True
            await wait_health(s, NOT_SERVING)
            executor.restart(num_blocks=8)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokens_of(large, [])
            return await tokens_of(small, []), refused.value

    small_rest, refused = asyncio.run(run())
    assert len(small_rest) == 7
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "too small for this request" in refused.details()


def test_requests_through_an_adapter_the_restarted_executor_lacks_fail_naming_the_field():
    # An adapter loaded at run time is gone with the executor: its stream is refused as the request would be now
    # (INVALID_ARGUMENT, lora), not as too large for the cache, and the base model's stream carries on.
    executor = FlakyExecutor()
    executor.inner.info = replace(executor.inner.info, lora_adapters=(LoraAdapterInfo(1, "a1"),), max_lora_rank=8)
    executor.inner.table.lora_ids = {1}
    executor.step_delay_s = 0.05

    async def run():
        async with scheduler(executor) as s:
            tuned_request = token_request([4, 5, 6], 8, ignore_eos=True)
            tuned_request.lora = "a1"
            base, tuned = s.stub.Generate(token_request([1, 2, 3], 8, ignore_eos=True)), s.stub.Generate(tuned_request)
            first = (await base.read()).token_ids
            await tuned.read()
            executor.down = True
            await wait_health(s, NOT_SERVING)
            executor.restart()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokens_of(tuned, [])
            return await tokens_of(base, first), refused.value

    tokens, refused = asyncio.run(run())
    assert tokens == expected_tokens([1, 2, 3], 8)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details().startswith("lora:")


def test_an_executor_with_another_vocabulary_fails_requests_until_the_right_one_is_back():
    executor = FlakyExecutor()
    executor.step_delay_s = 0.01

    async def run():
        async with scheduler(executor) as s:
            (call,) = await started_streams(s, [[1, 2, 3]], 50)
            executor.down = True
            await wait_health(s, NOT_SERVING)
            executor.restart(vocab_size=60)
            with pytest.raises(grpc.aio.AioRpcError) as in_flight:
                await tokens_of(call, [])
            with pytest.raises(grpc.aio.AioRpcError) as new:
                await s.stub.GenerateOnce(token_request([1, 2], 3))
            assert await health(s) == NOT_SERVING
            executor.restart(vocab_size=VOCAB)
            await wait_health(s, SERVING)
            after = await s.stub.GenerateOnce(token_request([4, 5], 6, ignore_eos=True))
            return in_flight.value, new.value, list(after.token_ids)

    in_flight, new, after = asyncio.run(run())
    for error in (in_flight, new):
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "vocab 60" in error.details()
    assert after == expected_tokens([4, 5], 6)


def test_a_deadline_passing_during_an_outage_frees_the_request():
    executor = FlakyExecutor()
    executor.step_delay_s = 0.002

    async def run():
        async with scheduler(executor) as s:
            call = s.stub.Generate(token_request([1, 2, 3], 200, ignore_eos=True), timeout=1.0)
            await call.read()
            executor.down = True
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await tokens_of(call, [])
            executor.restart()
            await wait_health(s, SERVING)
            return expired.value, await assert_idle_async(s.stub)

    expired, stats = asyncio.run(run())
    assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stats.num_aborted == 1


def refused_then_served(refusing: str, max_tokens: int, **config: object) -> tuple[grpc.aio.AioRpcError, list[int]]:
    """A request while the executor refuses (``FlakyExecutor``'s switch ``refusing`` on), then one after."""
    executor = FlakyExecutor()

    async def run():
        async with scheduler(executor, **config) as s:
            setattr(executor, refusing, True)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.GenerateOnce(token_request([1, 2, 3], max_tokens, ignore_eos=True))
            setattr(executor, refusing, False)
            await wait_health(s, SERVING)
            after = await s.stub.GenerateOnce(token_request([1, 2, 3], 5, ignore_eos=True))
            return refused.value, list(after.token_ids)

    return asyncio.run(run())


def test_work_the_executor_keeps_refusing_fails_with_internal_and_the_scheduler_carries_on():
    refused, after = refused_then_served("refuse_plans", 5)
    assert refused.code() == grpc.StatusCode.INTERNAL and "injected: plan refused" in refused.details()
    assert after == expected_tokens([1, 2, 3], 5)


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
def test_a_decode_the_executor_always_refuses_fails_after_three_tries_not_a_token_per_recovery(policy):
    refused, after = refused_then_served("refuse_decodes", 30, scheduling_policy=policy)
    assert refused.code() == grpc.StatusCode.INTERNAL and "injected: decode refused" in refused.details()
    assert after == expected_tokens([1, 2, 3], 5)


def test_queued_prompt_tokens_are_bounded():
    executor = FlakyExecutor(num_blocks=256)

    async def run():
        async with scheduler(executor, max_queued_tokens=20) as s:
            executor.down = True
            waiting = [asyncio.ensure_future(s.stub.GenerateOnce(token_request(list(range(1, 9)), 4, ignore_eos=True)))
                       for _ in range(2)]
            await wait_health(s, NOT_SERVING)
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await s.stub.GenerateOnce(token_request(list(range(1, 9)), 4))
            with pytest.raises(grpc.aio.AioRpcError) as too_long:
                await s.stub.GenerateOnce(token_request(list(range(1, 30)), 4))
            executor.restart()
            done = await asyncio.gather(*waiting)
            after = await s.stub.GenerateOnce(token_request(list(range(1, 9)), 4, ignore_eos=True))
            return full.value, too_long.value, [list(r.token_ids) for r in [*done, after]]

    full, too_long, tokens = asyncio.run(run())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-tokens 20" in full.details()
    assert too_long.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-queued-tokens" in too_long.details()
    assert tokens == [expected_tokens(list(range(1, 9)), 4)] * 3


def test_shutdown_lets_requests_in_flight_finish_and_refuses_new_ones():
    executor = FlakyExecutor(num_blocks=256)
    executor.step_delay_s = 0.005

    async def run():
        async with in_process_scheduler(executor, shutdown_grace=30) as s:
            (call,) = await started_streams(s, [[1, 2, 3]], 200)
            stopping = asyncio.ensure_future(s.server.stop())
            await wait_health(s, NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.GenerateOnce(token_request([1, 2], 3))
            rest = await rest_of(call)
            await stopping
            return refused.value, rest

    refused, rest = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(executor.inner.table) == 0


def test_shutdown_aborts_what_is_left_when_the_grace_period_ends():
    executor = FlakyExecutor(num_blocks=256)
    executor.step_delay_s = 0.01

    async def run():
        async with in_process_scheduler(executor, shutdown_grace=0.5) as s:
            (call,) = await started_streams(s, [[1, 2, 3]], 200)
            executor.down = True
            started = time.monotonic()
            await s.server.stop()
            return await rest_of(call), time.monotonic() - started

    rest, elapsed = asyncio.run(run())
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].usage.prompt_tokens == 3
    assert 0.5 <= elapsed < 5
