"""Without overlap (a CPU executor) the engine loop sends the next plan before it processes a step's outputs: what
must still go first, a request's first token and a resync, goes first."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.step import StepPlan, StepResult
from tests.service_fixtures import assert_idle_async, in_process_scheduler, stream, token_request
from tests.test_service_loop import RecordingExecutor, expected_tokens, shadow

PROMPT = [1, 2, 3]


@pytest.mark.parametrize("resumed", [0, 2], ids=["fresh", "resumed"])
def test_the_next_plan_leaves_before_a_steps_outputs_but_not_before_a_first_token(resumed: int):
    # The executor computes the next step while the outputs are sent, yet a request's first token (a resumed one's
    # first new token) reaches its client before that forward takes the cores.
    executor = RecordingExecutor(shadow())
    plans_before: dict[int, int] = {}  # tokens delivered: plans handed to the executor's thread by then
    expected = expected_tokens(PROMPT, 6)

    async def run():
        async with in_process_scheduler(executor, overlap=False, num_scheduler_steps=1) as s:
            loop, deliver = s.server.loop, s.server.loop.deliver
            sent = [0]

            def recording(outbox):
                sent[0] += sum(len(output.token_ids) for _, output in outbox)
                # Plans built are handed to the executor's thread in the same call (``Engine._launch``): counted on
                # the loop's thread, without waiting for that thread to start on them.
                plans_before[sent[0]] = loop.engine.planner.step_id
                deliver(outbox)

            loop.deliver = recording
            request = token_request(PROMPT, 6, ignore_eos=True)
            request.resume.completion_token_ids.extend(expected[:resumed])
            got = await stream(s.stub, request)
            await assert_idle_async(s.stub)
            return got

    assert asyncio.run(run()).token_ids == expected[resumed:]
    assert plans_before[1] == 1, f"the first token waited for the next plan: {plans_before}"
    new = 6 - resumed
    assert all(plans_before[t] == t + 1 for t in range(2, new)), f"the executor waited for the outputs: {plans_before}"


class SlowExecutor(RecordingExecutor):
    """Takes a few milliseconds a step, as a forward pass does, and notes how many plans it had at each reset."""

    def __init__(self) -> None:
        super().__init__(shadow())
        self.resets_at: list[int] = []

    def reset(self) -> int:
        self.resets_at.append(len(self.plans))
        return super().reset()

    def step(self, plan: StepPlan) -> StepResult:
        time.sleep(0.003)
        return super().step(plan)


def test_a_resync_takes_its_turn_between_steps_sent_ahead():
    # A recording starting resyncs the executor: it must not wait for the running requests to end while each step's
    # successor leaves early, and the request it interrupts still gets its exact tokens.
    executor, max_tokens = SlowExecutor(), 150

    async def run():
        async with in_process_scheduler(executor, overlap=False, num_scheduler_steps=1) as s:
            call = asyncio.ensure_future(stream(s.stub, token_request(PROMPT, max_tokens, ignore_eos=True)))
            while len(executor.plans) < 10:
                await asyncio.sleep(0.001)
            resets = len(executor.resets_at)
            s.server.loop.resync()
            got = await call
            await assert_idle_async(s.stub)
            return resets, got

    resets, got = asyncio.run(run())
    assert got.token_ids == expected_tokens(PROMPT, max_tokens)
    assert len(executor.resets_at) > resets, "the resync never ran"
    assert executor.resets_at[resets] < 50, f"the resync waited for the request: resets at plans {executor.resets_at}"
