"""Requests in priority order (``--request-order priority``, vLLM's priority scheduling): admitted lowest priority
value first, arrival breaking ties; the lowest priority preempted first; the tokens unchanged; arrival order (the
seed's) refusing a priority over gRPC and HTTP, naming the field."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from client.request_builder import build_request
from executor_svc.fakes.shadow import ShadowExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.engine.engine import Engine
from tests.conftest import EOS, assert_all_blocks_free
from tests.http_fixtures import hosted
from tests.service_fixtures import GatedExecutor, assert_idle_async, in_process_scheduler, stream
from tests.shadow_helpers import RecordingExecutor, expected

VOCAB = 50
POLICIES = ("nano-vllm", "mixed")


def engine_of(policy: str, order: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Engine:
    config = SchedulerConfig(max_num_seqs, 16, 1, policy, request_order=order)
    return Engine(ShadowExecutor(num_blocks, 4, VOCAB, (EOS,)), config)


def first_token_order(engine: Engine, seqs: list[Sequence]) -> list[int]:
    """Run to the end; the sequences' ids in the order their first tokens came."""
    order: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq.seq_id not in order:
                order.append(out.seq.seq_id)
    engine.step()  # idle: the executor drops the finished requests
    assert_all_blocks_free(engine.block_manager)
    return order


@pytest.mark.parametrize("policy", POLICIES)
def test_the_lowest_priority_value_is_admitted_first_and_arrival_breaks_ties(policy):
    engine = engine_of(policy, "priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    priorities = [5, 0, 5, -1, 0]
    seqs = [engine.add_request([1 + i, 2, 3], params, priority=p) for i, p in enumerate(priorities)]
    # -1 first; then the two 0s and the two 5s, each pair in arrival order
    assert first_token_order(engine, seqs) == [seqs[i].seq_id for i in (3, 1, 4, 0, 2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_in_arrival_order_requests_start_as_they_came(policy):
    engine = engine_of(policy, "fcfs", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seqs = [engine.add_request([1 + i, 2, 3], params) for i in range(4)]
    assert first_token_order(engine, seqs) == [seq.seq_id for seq in seqs]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("order", ["fcfs", "priority"])
def test_the_lowest_priority_is_preempted_first_and_tokens_stay_the_same(policy, order):
    """Two prompts of a block each, one block free: at their first decode both need another. In arrival order the
    later one is preempted; in priority order the one that matters less, though it came first."""
    engine = engine_of(policy, order, num_blocks=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    first, second = (engine.add_request(prompt, params, priority=p if order == "priority" else 0)
                     for prompt, p in zip(prompts, (1, 0), strict=True))
    while not engine.scheduler.num_preemptions:
        engine.step()
    assert list(engine.scheduler.waiting) == [first if order == "priority" else second]
    while engine.has_unfinished():
        engine.step()
    engine.step()
    for seq, prompt in zip((first, second), prompts, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, params)
    assert_all_blocks_free(engine.block_manager)


def test_a_request_arriving_with_a_lower_value_never_displaces_a_prompt_part_way_through_its_chunks():
    engine = engine_of("nano-vllm", "priority", max_num_seqs=2)  # 16 tokens a step: a 30-token prompt takes two
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = engine.add_request(list(range(1, 31)), params, priority=3)
    engine.step()  # its first chunk
    urgent = engine.add_request([40, 41], params, priority=-5)
    assert list(engine.scheduler.waiting) == [long, urgent]
    assert first_token_order(engine, [long, urgent]) == [long.seq_id, urgent.seq_id]


def test_arrival_order_refuses_a_priority_naming_the_field():
    engine = engine_of("nano-vllm", "fcfs")
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    assert refused.value.field == "priority" and "--request-order priority" in str(refused.value)
    assert not engine.has_unfinished()


def test_over_grpc_priority_is_honoured_or_refused_by_the_flag():
    prompt = dict(token_ids=[1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        async with in_process_scheduler(ShadowExecutor(64, 4, VOCAB, (EOS,)), request_order="priority") as s:
            assert len((await stream(s.stub, build_request(**prompt, priority=-7))).token_ids) == 2
        async with in_process_scheduler(ShadowExecutor(64, 4, VOCAB, (EOS,))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream(s.stub, build_request(**prompt, priority=1))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in refused.value.details()
            assert len((await stream(s.stub, build_request(**prompt, priority=0))).token_ids) == 2
            await assert_idle_async(s.stub)

    asyncio.run(run())


def test_over_http_priority_is_vllms_parameter():
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with hosted(ShadowExecutor(64, 4, VOCAB, (EOS,)), request_order="priority") as h:
        ok = httpx.post(f"{h.url}/v1/completions", json={**body, "priority": 3}, timeout=30)
        h.assert_idle()
    with hosted(ShadowExecutor(64, 4, VOCAB, (EOS,))) as h:
        refused = httpx.post(f"{h.url}/v1/completions", json={**body, "priority": 3}, timeout=30)
        too_big = httpx.post(f"{h.url}/v1/completions", json={**body, "priority": 2**31}, timeout=30)
        plain = httpx.post(f"{h.url}/v1/completions", json={**body, "priority": 0}, timeout=30)
        h.assert_idle()
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    assert too_big.status_code == 400 and "priority" in too_big.text
    assert plain.status_code == 200


def test_a_sequence_held_for_its_token_in_flight_keeps_its_place_by_priority():
    """With overlap a sequence whose last token is still in flight is held out of a decode step; it goes back to
    ``running`` in its place by priority, so the tail that preemption takes stays the request that matters least."""
    scheduler = Scheduler(SchedulerConfig(request_order="priority"), BlockManager(64, 4), {EOS}, 4096)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seqs = []
    for seq_id, priority in enumerate((0, 5, 7)):
        seq = Sequence(seq_id, [1 + seq_id, 2, 3], params, 4)
        seq.priority = priority
        scheduler.add(seq)
        seqs.append(seq)
    scheduled, is_prefill = scheduler.schedule()
    scheduler.postprocess(scheduled, [4] * len(scheduled), is_prefill)
    seqs[0].final_token_pending = True  # its last token is in the step in flight
    scheduled, _ = scheduler.schedule()
    assert seqs[0] not in scheduled
    assert [seq.priority for seq in scheduler.running] == [0, 5, 7]
    late = Sequence(3, [9, 9, 9], params, 4)
    late.priority = 3
    scheduler.add(late)
    scheduled, is_prefill = scheduler.schedule()
    assert is_prefill and scheduled == [late]
    assert [seq.priority for seq in scheduler.running] == [0, 3, 5, 7]
    for seq in [*scheduler.running, *scheduler.waiting]:
        scheduler.finish(seq, FinishReason.ABORT)
    assert_all_blocks_free(scheduler.block_manager)


def test_the_other_choices_of_a_request_keep_its_arrival():
    """Choices after the first of an n > 1 request are queued once the first one's prompt is computed; they rank by
    the request's arrival, ahead of a request of the same priority that came after it (vLLM's children keep their
    parent's arrival time)."""
    engine = engine_of("nano-vllm", "priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params)
    later = engine.add_request([4, 5, 6], params)
    other_choice = engine.enqueue([1, 2, 3], params, arrival=first.seq_id)
    assert first_token_order(engine, [first, later, other_choice]) == [first.seq_id, other_choice.seq_id, later.seq_id]


def test_over_grpc_a_requests_second_choice_runs_before_a_later_request():
    """One seat (max_num_seqs 1), held by a first request while a two-choice request and then a third arrive: once
    the two-choice request's first choice has its prompt computed, its second choice goes before the third request,
    which came later though the engine took it in first."""
    executor = RecordingExecutor(ShadowExecutor(64, 4, VOCAB, (EOS,)))
    gated = GatedExecutor(executor)
    tokens = dict(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        async with in_process_scheduler(gated, request_order="priority", max_num_seqs=1, overlap=False) as s:

            async def read(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
                return [r async for r in s.stub.Generate(request)]

            async def waiting(n: int) -> None:  # requests the scheduler has taken in (the engine loop is at the gate)
                while len(s.server.frontend.by_request_id) < n:
                    await asyncio.sleep(0.01)

            gated.open.clear()  # the first request's prefill waits at the gate while the others arrive
            gated.entered.clear()
            calls = [asyncio.ensure_future(read(build_request(token_ids=[7, 8, 9], **tokens)))]
            await asyncio.to_thread(gated.entered.wait, 30)
            calls.append(asyncio.ensure_future(read(build_request(token_ids=[1, 2, 3], n=2, **tokens))))
            await waiting(2)
            calls.append(asyncio.ensure_future(read(build_request(token_ids=[4, 5, 6], **tokens))))
            await waiting(3)
            gated.open.set()
            await asyncio.gather(*calls)
            await assert_idle_async(s.stub)
        return [new.request_id for plan in executor.plans for new in plan.new_requests]

    # Ids as the engine took them in: the first request 0, the two-choice one 1, the third 2, the second choice 3.
    assert asyncio.run(run()) == [0, 1, 3, 2]
