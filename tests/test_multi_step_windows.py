"""Multi-step decode windows: capped by what readers take at a time, cut short by arrivals, tokens unchanged."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from common.executor import Executor
from common.step import CachedRequests, StepPlan, StepResult
from executor_svc.core.request_table import PlanError
from executor_svc.core.step_pipeline import PreparedStep
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import build_server
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.planner import Planner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.conftest import EOS, assert_all_blocks_free
from tests.service_fixtures import assert_idle_async, collect, in_process_scheduler, token_request
from tests.shadow_helpers import assert_matches_reference, expected


class WindowShadow(ShadowExecutor):
    """A shadow executor that keeps every plan and result, whose passes can be slowed, and that can cut its own
    windows after a random pass (as CutStep would)."""

    def __init__(self, *args: object, pass_s: float = 0.0, cut_rng: random.Random | None = None,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.pass_s = pass_s
        self.cut_rng = cut_rng
        self.plans: list[StepPlan] = []
        self.results: list[StepResult] = []
        self.window_started = threading.Event()
        self.cuts: list[int] = []
        self.num_passes = 0
        self._running: int | None = None

    def prepare(self, plan: StepPlan) -> PreparedStep:
        self.plans.append(copy.deepcopy(plan))
        return super().prepare(plan)

    def execute(self, prepared: PreparedStep) -> StepResult:
        self._running = prepared.step_id
        if not prepared.single:
            self.window_started.set()
        result = super().execute(prepared)
        self.results.append(result)
        return result

    def forward(self, chunks, inputs=None) -> StepResult:
        self.num_passes += 1
        time.sleep(self.pass_s)
        output = super().forward(chunks, inputs)
        if self.cut_rng is not None and self.cut_rng.random() < 0.3:
            self.cut(self._running)
        return output

    def cut(self, step_id: int) -> None:
        self.cuts.append(step_id)
        super().cut(step_id)

    def cut_short(self) -> list[StepResult]:
        """The results of windows a cut stopped after one pass or more."""
        return [r for r in self.results if r.num_passes is not None and r.num_passes > 0]

    def dropped(self) -> list[int]:
        """The step ids of plans dropped unapplied (booked on a window that was cut), in order."""
        return [r.step_id for r in self.results if r.num_passes is not None and r.num_passes == 0]

    def decode_steps(self) -> list[int]:
        """Each decode plan's most steps per request (1 without num_decode_steps)."""
        return [max(p.cached_requests.num_decode_steps, default=1) for p in self.plans
                if not p.is_prefill and p.cached_requests.request_ids]


def random_work(rng: random.Random, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(2, 25))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=i % 3 == 0)
              for i in range(n)]
    return prompts, params


@contextmanager
def driven(executor: WindowShadow, over_grpc: bool) -> Iterator[Executor]:
    """``executor`` itself, or a ``RemoteExecutor`` to it through a StepStream server (plans prepared on its reader
    thread, executed on another)."""
    if not over_grpc:
        yield executor
        return
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    remote = RemoteExecutor(f"127.0.0.1:{port}")
    try:
        yield remote
    finally:
        remote.close()
        server.stop(None)


@pytest.mark.parametrize(("overlap", "over_grpc"), [(False, False), (True, False), (True, True)],
                         ids=["sync", "overlap", "overlap-grpc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windows_cut_after_any_pass_give_the_same_tokens_and_free_every_block(overlap, over_grpc, seed):
    rng = random.Random(seed)
    executor = WindowShadow(24, 4, 50, (EOS,), max_model_len=60, cut_rng=random.Random(seed + 100))
    prompts, params = random_work(rng, 12)
    with driven(executor, over_grpc) as target:
        engine = Engine(target, SchedulerConfig(6, 32, num_scheduler_steps=8), overlap=overlap)
        told: list[int] = []
        engine.on_step = lambda num_tokens, forward_s: told.append(num_tokens)
        outputs = engine.generate(prompts, params)
    assert_matches_reference(engine, prompts, params, outputs)
    # The iteration-tokens metric counts the tokens each collected step computed, a cut window's included.
    plans = {p.step_id: p for p in executor.plans}
    collected = [r for r in executor.results if not (r.num_passes is not None and r.num_passes == 0)
                 and (plans[r.step_id].new_requests or plans[r.step_id].cached_requests.request_ids)]
    assert len(collected) == len(told)
    assert all(n == len(r.token_ids) for n, r in zip(told, collected, strict=True)
               if not plans[r.step_id].is_prefill)
    cut = executor.cut_short()
    assert cut, "no window was cut"
    assert all(r.num_passes < 8 for r in cut)
    dropped = set(executor.dropped())
    booked_on = {p.step_id: p.after_whole_step_id for p in executor.plans if p.after_whole_step_id is not None}
    if overlap:
        assert dropped, "a window booked on a cut one is dropped"
        assert {booked_on[step_id] for step_id in dropped} <= {r.step_id for r in cut}
    else:
        assert not booked_on
    assert engine.scheduler.num_preemptions > 0, "24 blocks for 6 sequences should preempt some"
    assert len(executor.table) == 0
    assert_all_blocks_free(engine.block_manager)


def test_a_window_takes_no_more_steps_than_its_most_eager_reader():
    executor = WindowShadow(64, 4, 50, (EOS,))
    engine = Engine(executor, SchedulerConfig(num_scheduler_steps=8))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt, take in (([1, 2, 3], 3), ([4, 5, 6, 7], float("inf"))):
        engine.add_request(prompt, params).max_decode_steps = take
    while engine.has_unfinished():
        engine.step()
    assert max(executor.decode_steps()) == 3, "a reader taking 3 tokens at a time caps every window at 3"
    assert_all_blocks_free(engine.block_manager)

    alone = WindowShadow(64, 4, 50, (EOS,))
    engine = Engine(alone, SchedulerConfig(num_scheduler_steps=8))
    outputs = engine.generate([[4, 5, 6, 7]], params)
    assert max(alone.decode_steps()) == 8 and len(outputs[0].token_ids) == 30
    assert_all_blocks_free(engine.block_manager)


def test_a_token_by_token_stream_gets_one_step_plans_at_default_flags():
    executor = WindowShadow(64, 4, 50, (EOS,))

    async def main():
        async with in_process_scheduler(executor) as s:
            got = collect([r async for r in s.stub.Generate(token_request([3, 4, 5], 20, ignore_eos=True))])
            await assert_idle_async(s.stub)
            return got

    got = asyncio.run(main())
    assert len(got.token_ids) == 20
    assert set(executor.decode_steps()) == {1}


def test_streams_the_api_process_paces_decode_in_windows_of_what_each_takes_at_a_time():
    """The API process holding outputs (at a hundredth of a core, writing two streams holds the next tokens for
    milliseconds) tells the scheduler what each stream took at a time: their plans become windows, their tokens stay
    the same, every block is freed."""
    executor = WindowShadow(512, 4, 50, (EOS,), pass_s=0.0005)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]

    async def main():
        async with in_process_scheduler(executor, api_process=True, api_process_cpu_share=0.01) as s:
            got = await asyncio.gather(*(collect_stream(s.stub, prompt) for prompt in prompts))
            await assert_idle_async(s.stub)
            return got

    async def collect_stream(stub, prompt: list[int]):
        return collect([r async for r in stub.Generate(token_request(prompt, 1000, ignore_eos=True))])

    got = asyncio.run(main())
    engine = Engine(WindowShadow(512, 4, 50, (EOS,)), SchedulerConfig())
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    assert [g.token_ids for g in got] == [expected(engine, prompt, params) for prompt in prompts]
    steps = executor.decode_steps()
    assert steps[0] == 1, "token-by-token streams start one step a plan"
    assert max(steps) > 1, "held streams' plans never became windows"
    assert max(steps) <= 8, "a window longer than --num-scheduler-steps"


def test_an_arriving_stream_cuts_the_window_in_flight_and_starts_next():
    """A whole completion decodes in windows of 8 slow passes; a stream sent once one is under way is prefilled
    right after the pass in progress, not after the rest of the window."""
    executor = WindowShadow(64, 4, 50, (EOS,), pass_s=0.05)
    whole = token_request([3, 4, 5], 40, ignore_eos=True)
    streamed = token_request([6, 7, 8, 9], 5, ignore_eos=True)

    async def main():
        async with in_process_scheduler(executor) as s:
            first = asyncio.ensure_future(s.stub.GenerateOnce(whole))
            await asyncio.to_thread(executor.window_started.wait, 10)
            second = collect([r async for r in s.stub.Generate(streamed)])
            done = collect([await first])
            await assert_idle_async(s.stub)
            return done, second

    done, second = asyncio.run(main())
    assert len(done.token_ids) == 40 and len(second.token_ids) == 5
    windows = executor.cut_short()
    assert windows and windows[0].num_passes < 8, "the window in flight ran whole"
    dropped = set(executor.dropped())
    ran = [p for p in executor.plans if p.step_id not in dropped]
    cut_at = next(i for i, p in enumerate(ran) if p.step_id == windows[0].step_id)
    next_plan = ran[cut_at + 1]
    assert [list(r.token_ids) for r in next_plan.new_requests] == [[6, 7, 8, 9]], "the stream's prefill is next"


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another"])
def test_an_abort_cuts_the_window_in_flight_and_is_answered_after_the_pass_in_progress(beside):
    """A whole completion decodes in windows of 8 slow passes; aborted once one is under way, it ends with ABORT
    after the pass in progress, not after the rest of the window, nor after the next window of a request beside."""
    executor = WindowShadow(64, 4, 50, (EOS,), pass_s=0.05)
    whole = token_request([3, 4, 5], 40, ignore_eos=True)
    whole.request_id = "whole"
    other = token_request([6, 7, 8, 9], 48, ignore_eos=True)

    async def main():
        async with in_process_scheduler(executor) as s:
            answer = asyncio.ensure_future(s.stub.GenerateOnce(whole))
            rest = asyncio.ensure_future(s.stub.GenerateOnce(other)) if beside else None
            await asyncio.to_thread(executor.window_started.wait, 10)
            async with asyncio.timeout(10):
                while beside and not any(len(p.cached_requests.request_ids) == 2 and p.after_whole_step_id is not None
                                         for p in executor.plans):
                    await asyncio.sleep(0.01)  # until a window of both is booked on one of both
            passes_before = executor.num_passes
            aborted = await s.stub.Abort(pb.AbortRequest(request_ids=["whole"]))
            done = await answer
            passes_until_answer = executor.num_passes - passes_before
            if rest is not None:
                assert len((await rest).token_ids) == 48
            await assert_idle_async(s.stub)
            return aborted, done, passes_until_answer

    aborted, done, passes_until_answer = asyncio.run(main())
    assert list(aborted.aborted_request_ids) == ["whole"]
    assert done.finish_reason == pb.FINISH_REASON_ABORT
    assert done.usage.completion_tokens < 1 + 8, "the prefill's token and the passes before the cut, not a window"
    assert passes_until_answer < 8, "the answer waited for a whole window"
    windows = executor.cut_short()
    assert windows and windows[0].num_passes < 8


def test_the_other_choices_of_a_request_cut_the_window_of_the_first():
    """With n = 2 the second choice starts once the first's prompt is computed, while the first's window of 8 is
    already under way: that window is cut, so the second choice's prefill comes after the pass in progress."""
    executor = WindowShadow(64, 4, 50, (EOS,), pass_s=0.02)
    request = token_request([3, 4, 5], 24, ignore_eos=True)
    request.sampling.n = 2
    request.sampling.temperature = 0
    request.stream_interval = 64

    async def main():
        async with in_process_scheduler(executor) as s:
            responses = [r async for r in s.stub.Generate(request)]
            await assert_idle_async(s.stub)
            return responses

    choices: dict[int, list[int]] = {}
    for r in asyncio.run(main()):
        choices.setdefault(r.index, []).extend(r.token_ids)
    assert choices[0] == choices[1] and len(choices[0]) == 24
    prefills = [p for p in executor.plans if p.new_requests]
    assert len(prefills) == 2
    before = [p for p in executor.plans if p.step_id < prefills[1].step_id and not p.is_prefill]
    assert before and executor.cuts and executor.cuts[0] == before[-1].step_id, "the first choice's window ran whole"


@pytest.mark.parametrize(("device", "flags", "window"),
                         [("cpu", {}, 8), ("cuda", {}, 8), ("cuda", {"num_scheduler_steps": 4}, 4)],
                         ids=["cpu-default", "accelerator-default", "flag"])
def test_whole_completions_decode_in_windows_of_8_by_default_on_any_device(device, flags, window):
    executor = WindowShadow(64, 4, 50, (EOS,))
    executor.info = replace(executor.info, device=device)

    async def main():
        async with in_process_scheduler(executor, **flags) as s:
            done = collect([await s.stub.GenerateOnce(token_request([3, 4, 5], 33, ignore_eos=True))])
            await assert_idle_async(s.stub)
            return done

    done = asyncio.run(main())
    assert len(done.token_ids) == 33
    assert max(executor.decode_steps()) == window


def test_cut_step_over_grpc_stops_the_window_after_its_pass_in_progress():
    executor = WindowShadow(64, 4, 50, (EOS,), pass_s=0.05)
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    remote = RemoteExecutor(f"127.0.0.1:{port}")
    try:
        engine = Engine(remote, SchedulerConfig(num_scheduler_steps=8), overlap=True)
        params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
        prompts = [[1, 2, 3], [4, 5]]
        for prompt in prompts:
            engine.add_request(prompt, params)
        def arrivals() -> None:  # a burst: the first cuts, the rest find the window cut already
            if executor.window_started.wait(10):
                for _ in range(3):
                    engine.cut_for_loop()

        threading.Thread(target=arrivals).start()
        outputs: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.seq.seq_id, []).extend(out.token_ids)
            engine.loop_work_taken()
        engine.step()  # idle: tells the executor to drop the finished requests
        cut = executor.cut_short()
        assert len(cut) == 1 and cut[0].num_passes < 8
        # One CutStep for the burst; a window booked ahead as it came is cut once more as it goes out.
        assert executor.cuts and len(executor.cuts) == len(set(executor.cuts)), executor.cuts
        dropped = executor.dropped()
        booked_on = {p.step_id: p.after_whole_step_id for p in executor.plans if p.after_whole_step_id is not None}
        assert [booked_on[step_id] for step_id in dropped] == [cut[0].step_id], "the window booked on it is dropped"
        assert [outputs[i] for i in (0, 1)] == [expected(engine, p, params) for p in prompts]
        assert len(executor.table) == 0
        assert_all_blocks_free(engine.block_manager)
    finally:
        remote.close()
        server.stop(None)


def test_a_plan_given_back_sends_its_new_blocks_and_drops_again():
    planner = Planner()
    kept, gone = (Sequence(i, [1, 2, 3], SamplingParams(), 4, 3) for i in range(2))
    kept.block_table, gone.block_table = [0], [1]
    planner.build([kept, gone], True, [])
    kept.block_table.append(2)
    dropped, _ = planner.build([kept], False, [gone.seq_id])
    with pytest.raises(ValueError, match="only the last plan"):
        planner.unbook(type(dropped)(dropped.step_id - 1, False, []))
    assert planner.unbook(dropped) == [gone.seq_id]
    again, _ = planner.build([kept], False, [gone.seq_id])
    assert again.finished_request_ids == [gone.seq_id]
    assert (again.cached_requests.num_new_blocks, again.cached_requests.new_block_ids) == ([1], [2])


def test_multi_step_plans_the_executor_cannot_run_are_refused_whole():
    executor = ShadowExecutor(8, 4, 50, (EOS,))
    engine = Engine(executor, SchedulerConfig(8, 64))
    seq = engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # prefill: 6 tokens held, 5 computed, 2 blocks
    before = {k: (list(v.token_ids), list(v.block_table), v.num_computed_tokens)
              for k, v in executor.table.requests.items()}

    def decode(**fields):
        cached = dict(request_ids=[seq.seq_id], num_computed_tokens=[5], num_scheduled_tokens=[1], num_new_blocks=[0])
        return StepPlan(cached_requests=CachedRequests(**(cached | fields)))

    bad_plans = {
        "more steps than its blocks hold": decode(num_decode_steps=[4]),
        "zero steps": decode(num_decode_steps=[0]),
        "two scheduled tokens": decode(num_decode_steps=[2], num_scheduled_tokens=[2]),
        "one entry too many": decode(num_decode_steps=[2, 2]),
        "a prefill plan": StepPlan(is_prefill=True, cached_requests=decode(num_decode_steps=[2]).cached_requests),
    }
    for why, plan in bad_plans.items():
        with pytest.raises(PlanError) as err:
            executor.step(plan)
        assert err.value.code == "INVALID_ARGUMENT", why
        after = {k: (list(v.token_ids), list(v.block_table), v.num_computed_tokens)
                 for k, v in executor.table.requests.items()}
        assert after == before, why
    result = executor.step(decode(num_decode_steps=[3]))  # positions 5..7: the two blocks hold them
    assert len(result.token_ids) == 3 and executor.table.requests[seq.seq_id].num_computed_tokens == 8
    engine.abort(seq)
    engine.step()
    assert len(executor.table) == 0
    assert_all_blocks_free(engine.block_manager)
