"""The engine loop's pause, through the gRPC API: a resume or a ``keep`` ends a pause call still waiting for an idle
engine (``PauseLifted``), the tokens of what ran staying exact; a drain lifts ``keep`` so that what runs may finish
in its grace period and refuses the requests held (ABORT, so their clients resume elsewhere); a pause call waiting
when the server stops fails, as does any call after."""

from __future__ import annotations

import asyncio

import pytest

from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.errors import ServerStopping
from scheduler_svc.engine.pause import PauseLifted
from tests.service_fixtures import assert_idle_async, in_process_scheduler, token_request
from tests.test_http_generate import SlowShadow

VOCAB = 50


def slow() -> SlowShadow:
    return SlowShadow(num_blocks=1024, block_size=4, vocab_size=VOCAB, max_model_len=4096)


async def tokens_of(call: object) -> tuple[list[int], int]:
    """A stream's tokens and its finish reason."""
    tokens, finish = [], 0
    async for response in call:
        tokens += response.token_ids
        finish = response.finish_reason or finish
    return tokens, finish


def test_a_resume_ends_a_pause_still_waiting_and_what_ran_keeps_its_tokens():
    async def run() -> None:
        async with in_process_scheduler(slow()) as s:
            loop = s.server.loop
            call = s.stub.Generate(token_request([1, 2, 3], 400, ignore_eos=True))
            reading = asyncio.ensure_future(tokens_of(call))
            while not loop.stats.num_running:
                await asyncio.sleep(0.01)
            waiting = asyncio.wrap_future(loop.pause("wait", True))
            await asyncio.sleep(0.05)
            assert not waiting.done(), "the request still runs"
            await asyncio.wrap_future(loop.resume())
            with pytest.raises(PauseLifted, match="a resume came first"):
                await waiting
            tokens, finish = await reading
            assert tokens == reference_generate([1, 2, 3], 400, VOCAB, {0}, True)
            assert finish == pb.FINISH_REASON_LENGTH and not loop.paused
            await assert_idle_async(s.stub)

    asyncio.run(run())


def test_keep_ends_a_wait_and_freezes_until_the_resume():
    async def run() -> None:
        async with in_process_scheduler(slow()) as s:
            loop = s.server.loop
            reading = asyncio.ensure_future(tokens_of(s.stub.Generate(token_request([4, 5], 300, ignore_eos=True))))
            while not loop.stats.num_running:
                await asyncio.sleep(0.01)
            waiting = asyncio.wrap_future(loop.pause("wait", False))
            await asyncio.wrap_future(loop.pause("keep", False))
            with pytest.raises(PauseLifted, match="keep"):
                await waiting
            steps = loop.stats.num_steps
            await asyncio.sleep(0.3)
            assert loop.stats.num_steps <= steps + 1 and not reading.done(), "frozen (a plan in flight may land)"
            await asyncio.wrap_future(loop.resume())
            assert (await reading)[0] == reference_generate([4, 5], 300, VOCAB, {0}, True)
            await assert_idle_async(s.stub)

    asyncio.run(run())


def test_a_drain_lets_what_runs_finish_and_refuses_what_waits():
    async def run() -> None:
        async with in_process_scheduler(slow(), shutdown_grace=30) as s:
            loop = s.server.loop
            running = asyncio.ensure_future(tokens_of(s.stub.Generate(token_request([6, 7], 60, ignore_eos=True))))
            while not loop.stats.num_running:
                await asyncio.sleep(0.01)
            await asyncio.wrap_future(loop.pause("keep", False))
            held = asyncio.ensure_future(tokens_of(s.stub.Generate(token_request([8, 9], 5))))
            while not loop.stats.num_waiting:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(s.server.stop())
            tokens, finish = await running
            assert tokens == reference_generate([6, 7], 60, VOCAB, {0}, True), "keep lifted: it finished in the grace"
            assert (await held) == ([], pb.FINISH_REASON_ABORT), "never started: refused, to be resumed elsewhere"
            await stopping

    asyncio.run(run())


def test_a_pause_waiting_when_the_server_stops_fails_and_leaves_no_caller_waiting():
    async def run() -> None:
        async with in_process_scheduler(slow(), shutdown_grace=0) as s:
            loop = s.server.loop
            running = asyncio.ensure_future(tokens_of(s.stub.Generate(token_request([6, 7], 3000, ignore_eos=True))))
            while not loop.stats.num_running:
                await asyncio.sleep(0.01)
            waiting = loop.pause("wait", True)
            held = asyncio.ensure_future(tokens_of(s.stub.Generate(token_request([8, 9], 5))))
            while not loop.stats.num_waiting:
                await asyncio.sleep(0.01)
            await s.server.stop()
            assert isinstance(waiting.exception(timeout=5), ServerStopping)
            assert (await running)[1] == (await held)[1] == pb.FINISH_REASON_ABORT
            assert isinstance(loop.resume().exception(timeout=5), ServerStopping), "a call after the end is told so"

    asyncio.run(run())
