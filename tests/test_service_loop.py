"""The engine loop behind an in-process server, with executors a test can hold, break or inspect."""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace

import grpc
import pytest

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult, TokenLogprobs
from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api.frontend import Frontend, Generation
from scheduler_svc.api.outbox import Outbox
from scheduler_svc.api.prepare import prepare
from scheduler_svc.core.errors import EngineFailure, RequestFailed, ServerStopping
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.core.validation import ModelLimits
from scheduler_svc.engine.stats import LoopStats
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    GatedExecutor,
    assert_idle_async,
    byte_level_tokenizer,
    in_process_scheduler,
    stream,
    token_request,
)

VOCAB = 50


def shadow(**kwargs) -> ShadowExecutor:
    return ShadowExecutor(**{"num_blocks": 64, "block_size": 4, "vocab_size": VOCAB, **kwargs})


class RecordingExecutor(Executor):
    """Keeps every plan."""

    def __init__(self, inner: ShadowExecutor) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(copy.deepcopy(plan))
        return self.inner.step(plan)


class LogprobExecutor(RecordingExecutor):
    """Adds made-up logprobs for requests that ask, as a real sampler would."""

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        for token_id in result.token_ids:
            result.logprobs.append(TokenLogprobs(-0.25, [token_id, 1], [-0.25, -2.0]))
        return result


def expected_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    return reference_generate(prompt, max_tokens, VOCAB, {0}, ignore_eos)


def test_a_full_queue_is_refused_and_nothing_else_is_disturbed():
    executor = GatedExecutor(shadow())

    async def run():
        async with in_process_scheduler(executor, max_num_seqs=1, max_queued_requests=2) as s:
            executor.open.clear()
            first = asyncio.ensure_future(stream(s.stub, token_request([1, 2, 3], 5, ignore_eos=True)))
            await asyncio.to_thread(executor.entered.wait, 5)
            # The loop is held inside a step: these can only queue up, or be refused.
            others = [
                asyncio.ensure_future(s.stub.GenerateOnce(token_request([4, 5, i], 5, ignore_eos=True)))
                for i in range(1, 7)
            ]
            done, _ = await asyncio.wait(others, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert done, "no request was refused while the queue was full"
            await asyncio.sleep(0.2)
            executor.open.set()
            results = await asyncio.gather(first, *others, return_exceptions=True)
            await assert_idle_async(s.stub)
            return results

    first, *others = asyncio.run(run())
    assert first.token_ids == expected_tokens([1, 2, 3], 5)
    refused = [r for r in others if isinstance(r, grpc.aio.AioRpcError)]
    accepted = [(i, r) for i, r in enumerate(others, start=1) if not isinstance(r, Exception)]
    assert len(refused) + len(accepted) == len(others)
    assert 1 <= len(accepted) <= 2, "max_queued_requests=2 admits at most two waiting requests"
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting to be scheduled" in e.details()
    for i, response in accepted:
        assert list(response.token_ids) == expected_tokens([4, 5, i], 5)


def test_cancel_frees_blocks_at_once_and_the_executor_drops_the_request():
    recording = RecordingExecutor(shadow(num_blocks=1024))
    executor = GatedExecutor(recording, steps_before_closing=3)  # a busy machine must not let it run to its end

    async def run():
        async with in_process_scheduler(executor) as s:
            stub = s.stub
            call = stub.Generate(token_request([9, 8, 7], 3000, ignore_eos=True))
            async for _ in call:
                break
            await asyncio.to_thread(executor.closed.wait, 10)
            call.cancel()
            await asyncio.sleep(0.2)  # the cancel reaches the engine loop while its step is held
            executor.open.set()
            return await assert_idle_async(stub)

    stats = asyncio.run(run())
    assert stats.num_aborted == 1
    seq_id = recording.plans[0].new_requests[0].request_id
    assert any(seq_id in plan.finished_request_ids for plan in recording.plans), "no plan dropped the request"
    assert len(recording.inner.table) == 0
    assert sum(1 for plan in recording.plans if plan.cached_requests.request_ids) < 2999, "it was not cancelled"


def test_idle_stats_wait_for_the_executor_to_drop_a_request_that_stopped_inside_a_window():
    # [1, 13, 7] reaches EOS at its 6th token, inside the first window of 8; the window after it was booked
    # while it ran, for the same sequence, and is held at the gate.
    prompt = [1, 13, 7]
    executor = GatedExecutor(RecordingExecutor(shadow()), steps_before_closing=2)

    async def run():
        async with in_process_scheduler(executor) as s:
            completion = await s.stub.GenerateOnce(token_request(prompt, 100))
            await asyncio.sleep(0.2)  # time enough for the loop to publish its stats, were it to
            held = await s.stub.GetStats(pb.GetStatsRequest())
            table_while_held = len(executor.inner.inner.table)
            executor.open.set()
            return completion, held, table_while_held, await assert_idle_async(s.stub)

    completion, held, table_while_held, stats = asyncio.run(run())
    assert list(completion.token_ids) == expected_tokens(prompt, 100, ignore_eos=False)
    assert len(completion.token_ids) == 6
    assert table_while_held == 1 and held.num_running == 1, "stats said idle while the executor held the request"
    booked = executor.inner.plans[2]
    assert booked.after_whole_step_id is not None and booked.cached_requests.request_ids, "no window was booked"
    assert stats.num_finished_stop == 1
    assert len(executor.inner.inner.table) == 0


def test_a_deadline_aborts_the_request_and_frees_its_blocks():
    # The prefill step runs and gives the first token; the first decode step then waits at the gate.
    executor = GatedExecutor(RecordingExecutor(shadow()), steps_before_closing=1)

    async def run():
        async with in_process_scheduler(executor) as s:
            call = s.stub.Generate(token_request([1, 2, 3], 100, ignore_eos=True), timeout=0.5)
            async for _ in call:
                break
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [r async for r in call]
            executor.open.set()
            return e.value, await assert_idle_async(s.stub)

    error, stats = asyncio.run(run())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stats.num_aborted == 1 and stats.num_finished_length == 0
    assert len(executor.inner.inner.table) == 0


def test_shutdown_without_grace_ends_streams_with_abort_and_clears_the_executor():
    executor = RecordingExecutor(shadow(num_blocks=1024))

    async def run():
        async with in_process_scheduler(executor, shutdown_grace=0) as s:
            call = s.stub.Generate(token_request([1, 2], 3000, ignore_eos=True))
            async for _ in call:
                break
            stopping = asyncio.ensure_future(s.server.stop())
            rest = [r async for r in call]
            await stopping
            return rest

    rest = asyncio.run(run())
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].usage.prompt_tokens == 2
    assert len(executor.inner.table) == 0


def test_logprobs_come_with_each_token_when_asked():
    executor = LogprobExecutor(shadow())

    async def run(stub: pb_grpc.GenerationStub, logprobs: int | None) -> list[pb.GenerateResponse]:
        request = token_request([3, 4], 4, ignore_eos=True)
        if logprobs is not None:
            request.sampling.logprobs = logprobs
        return [r async for r in stub.Generate(request)]

    async def both():
        async with in_process_scheduler(executor) as s:
            stub = s.stub
            with_lp, without = await run(stub, 1), await run(stub, None)
            await assert_idle_async(stub)
            return with_lp, without

    with_lp, without = asyncio.run(both())
    tokens = [t for r in with_lp for t in r.token_ids]
    logprobs = [lp for r in with_lp for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(lp.logprob == -0.25 and [t.token_id for t in lp.top] == [lp.token_id, 1] for lp in logprobs)
    assert not any(r.logprobs for r in without)
    assert executor.plans[0].new_requests[0].sampling.num_logprobs == 1


def test_chat_without_a_template_is_refused():
    executor = shadow(vocab_size=300, tokenizer_json=byte_level_tokenizer().to_str())

    async def run():
        async with in_process_scheduler(executor) as s:
            stub = s.stub
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GenerateOnce(pb.GenerateRequest(chat=chat))
            text = await stub.GenerateOnce(pb.GenerateRequest(text="hi", stopping=pb.StoppingOptions(max_tokens=3)))
            await assert_idle_async(stub)
            return info, e.value, text

    info, error, text = asyncio.run(run())
    assert info.has_tokenizer and not info.has_chat_template
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat template" in error.details()
    assert text.usage.completion_tokens == 3


def test_a_chat_template_is_used_when_present():
    executor = shadow(vocab_size=300, tokenizer_json=byte_level_tokenizer().to_str(), chat_template=CHATML_TEMPLATE)

    async def run():
        async with in_process_scheduler(executor) as s:
            stub = s.stub
            chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])
            response = await stub.GenerateOnce(pb.GenerateRequest(chat=chat, stopping=pb.StoppingOptions(max_tokens=2)))
            await assert_idle_async(stub)
            return response

    assert asyncio.run(run()).usage.prompt_tokens > 2


def test_an_outbox_hands_over_everything_since_the_last_take_and_outlives_a_reader_that_left():
    async def scenario() -> None:
        outbox = Outbox()
        reader = asyncio.create_task(outbox.take())
        await asyncio.sleep(0)
        outbox.put_nowait(RequestOutput(token_ids=[1]))
        outbox.put_nowait(RequestOutput(token_ids=[2]))
        assert [output.token_ids for output in await reader] == [[1], [2]]
        gone = asyncio.create_task(outbox.take())
        await asyncio.sleep(0)
        gone.cancel()
        outbox.put_nowait(RequestOutput(token_ids=[3]))
        assert [output.token_ids for output in await outbox.take()] == [[3]]

    asyncio.run(scenario())


def test_an_outbox_gathers_its_interval_of_tokens_but_hands_over_the_first_and_the_end_at_once():
    async def scenario() -> list[list[list[int]]]:
        outbox, taken = Outbox(stream_interval=3), []
        outbox.put_nowait(RequestOutput(token_ids=[1]))
        taken.append(await outbox.take())
        reader = asyncio.create_task(outbox.take())
        for token_id in (2, 3):
            outbox.put_nowait(RequestOutput(token_ids=[token_id]))
            await asyncio.sleep(0)
        assert not reader.done()
        outbox.put_nowait(RequestOutput(token_ids=[4]))
        taken.append(await reader)
        outbox.put_nowait(RequestOutput(token_ids=[5]))
        outbox.put_nowait(RequestOutput(token_ids=[6], finish_reason=FinishReason.LENGTH))
        taken.append(await outbox.take())
        return [[output.token_ids for output in outputs] for outputs in taken]

    assert asyncio.run(scenario()) == [[[1]], [[2], [3], [4]], [[5], [6]]]


def test_an_outbox_of_whole_completions_wakes_its_reader_only_when_a_choice_ends():
    async def scenario() -> list[list[tuple[int, list[int]]]]:
        outbox = Outbox(stream_interval=None)
        reader = asyncio.create_task(outbox.take())
        for index, token_id in ((0, 1), (1, 1), (0, 2), (1, 2)):
            outbox.put_nowait(RequestOutput(token_ids=[token_id], index=index))
            await asyncio.sleep(0)
        assert not reader.done()
        outbox.put_nowait(RequestOutput(token_ids=[3], index=1, finish_reason=FinishReason.STOP))
        first = await reader
        outbox.put_nowait(RequestOutput(token_ids=[3], index=0, finish_reason=FinishReason.LENGTH))
        return [[(output.index, output.token_ids) for output in outputs] for outputs in (first, await outbox.take())]

    assert asyncio.run(scenario()) == [[(0, [1]), (1, [1]), (0, [2]), (1, [2]), (1, [3])], [(0, [3])]]


def test_an_outbox_counts_its_interval_per_choice_and_starts_each_choice_at_once():
    async def scenario() -> list[list[tuple[int, list[int]]]]:
        outbox, taken = Outbox(stream_interval=2), []
        for index, token_id in ((0, 1), (1, 1)):
            outbox.put_nowait(RequestOutput(token_ids=[token_id], index=index))
            taken.append(await asyncio.wait_for(outbox.take(), timeout=5))  # due at once: no wait
        reader = asyncio.create_task(outbox.take())
        for index in (0, 1):
            outbox.put_nowait(RequestOutput(token_ids=[2], index=index))
        await asyncio.sleep(0)
        assert not reader.done()
        outbox.put_nowait(RequestOutput(token_ids=[3], index=0))
        taken.append(await reader)
        return [[(output.index, output.token_ids) for output in outputs] for outputs in taken]

    assert asyncio.run(scenario()) == [[(0, [1])], [(1, [1])], [(0, [2]), (1, [2]), (0, [3])]]


def test_a_failed_request_hands_over_what_came_before_its_error_then_raises_it():
    async def scenario() -> tuple[list[list[RequestOutput]], RequestFailed]:
        outbox = Outbox(stream_interval=4)
        handle = SimpleNamespace(prepared=SimpleNamespace(request_id="r", params=SimpleNamespace(n=2)))
        generation = Generation(Frontend("127.0.0.1:1"), handle, outbox)
        for output in (RequestOutput(token_ids=[1], index=0), RequestOutput(token_ids=[2], index=1),
                       RequestOutput(token_ids=[3], index=0, finish_reason=FinishReason.LENGTH),
                       RequestOutput(error=EngineFailure("the executor keeps failing"))):
            outbox.put_nowait(output)
        read = []
        with pytest.raises(RequestFailed) as failed:
            async for outputs in generation.batches():
                read.append(outputs)
        return read, failed.value

    read, error = asyncio.run(scenario())
    assert [[(o.index, o.token_ids, o.finish_reason) for o in outputs] for outputs in read] == [
        [(0, [1], None), (1, [2], None), (0, [3], FinishReason.LENGTH)]]
    assert "keeps failing" in str(error)


def test_whoever_reads_an_output_reads_stats_that_know_its_request():
    # A client that cancels after its first token and then reads GetStats must not read the stats from before its
    # request came (idle, nothing finished): it would take the server for idle with its request still running.
    seen: list[tuple[int, LoopStats]] = []

    async def run():
        async with in_process_scheduler(shadow(num_blocks=256)) as s:
            loop = s.server.loop
            deliver = loop.deliver

            def recording(outbox):
                seen.append((sum(len(output.token_ids) for _, output in outbox), loop.stats))
                deliver(outbox)

            loop.deliver = recording
            chunks = await stream(s.stub, token_request([1, 2, 3], 12, ignore_eos=True))
            await assert_idle_async(s.stub)
            return chunks

    chunks = asyncio.run(run())
    assert chunks.token_ids == expected_tokens([1, 2, 3], 12)
    assert sum(tokens for tokens, _ in seen) == 12
    for _, stats in seen:
        known = stats.num_waiting + stats.num_running + stats.num_finished_length
        assert known == 1, f"an output left the loop with the stats from before its request: {stats}"


def test_a_request_or_call_that_reaches_the_loop_after_it_ended_is_told_it_stops():
    # A request admitted just before the drain closed admission, or a call made then, would otherwise wait forever.
    async def run():
        async with in_process_scheduler(shadow()) as s:
            loop = s.server.loop
            prepared = prepare(token_request([1, 2], 3), ModelLimits.of(loop.info), None)
            loop.stop()
            loop.admission.closed = False  # as if admitted just before
            with pytest.raises(ServerStopping, match="shutting down"):
                loop.submit(prepared, object(), time.monotonic())
            late = loop.call(lambda engine: None)
            assert isinstance(late.exception(timeout=1), ServerStopping)
            assert loop.admission.num_requests == 0, "the refused request still counts in the queue"

    asyncio.run(run())
