"""The engine over the shadow-KV executor: outputs must equal the sequential reference."""

from __future__ import annotations

import math
import random

import grpc
import numpy as np
import pytest

from common.step import CachedRequests, NewRequest, StepPlan, StepResult
from executor_svc.core.request_table import PlanError
from executor_svc.fakes.shadow import HIT, ShadowExecutor, next_token
from executor_svc.service import build_server
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import RecordingExecutor, assert_matches_reference, expected, shadow_prompt_logprobs


def random_prompts(rng: random.Random, n: int, prefix_len: int = 0, lo: int = 1, hi: int = 20) -> list[list[int]]:
    prefix = [rng.randrange(1, 50) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, 50) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def recording_engine(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64):
    executor = RecordingExecutor(ShadowExecutor(num_blocks, block_size, 50, (EOS,)))
    return Engine(executor, SchedulerConfig(max_num_seqs, max_num_batched_tokens)), executor


def test_preemption_happens_and_outputs_are_unchanged(make_shadow_engine):
    engine, _ = make_shadow_engine(num_blocks=10, block_size=4, max_num_seqs=8)
    rng = random.Random(0)
    prompts = random_prompts(rng, 8, lo=3, hi=10)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_reference(engine, prompts, params, outputs)


def test_chunked_prefill_runs_more_than_one_chunk_and_outputs_are_unchanged():
    engine, executor = recording_engine(max_num_batched_tokens=8)
    rng = random.Random(1)
    prompts = random_prompts(rng, 4, lo=20, hi=30)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in prompts]
    outputs = engine.generate(prompts, params)
    chunks_of_first = [
        p for p in executor.plans
        if p.is_prefill and (any(r.request_id == 0 for r in p.new_requests) or 0 in p.cached_requests.request_ids)
    ]
    assert len(chunks_of_first) >= 3, "a 20+ token prompt under an 8-token budget needs several chunks"
    assert_matches_reference(engine, prompts, params, outputs)
    assert_all_blocks_free(engine.block_manager)


def test_prefix_cache_hits_serve_tokens_and_outputs_are_unchanged(make_shadow_engine):
    engine, _ = make_shadow_engine(num_blocks=64, block_size=4)
    rng = random.Random(2)
    prompts = random_prompts(rng, 6, prefix_len=13)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in prompts]
    first = engine.generate(prompts[:1], params[:1])
    rest = engine.generate(prompts[1:], params[1:])
    assert engine.scheduler.num_prefix_hit_tokens >= 12 * 5
    assert all(out.num_cached_prompt_tokens == 12 for out in rest)
    assert_matches_reference(engine, prompts, params, first + rest)


def test_two_sequences_with_the_same_prefix_in_one_step():
    engine, executor = recording_engine(num_blocks=32, block_size=4)
    rng = random.Random(3)
    prompts = random_prompts(rng, 2, prefix_len=9, lo=2, hi=3)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    outputs = engine.generate(prompts, params)
    first_plan = executor.plans[0]
    assert [r.request_id for r in first_plan.new_requests] == [0, 1], "both prefill in the same step"
    tables = [list(r.block_table) for r in first_plan.new_requests]
    assert tables[0][:2] != tables[1][:2], "neither can hit the other's uncomputed blocks"
    assert_matches_reference(engine, prompts, params, outputs)
    third = prompts[0][:9] + [7, 7, 7]
    later = engine.generate([third], params[:1])
    assert later[0].num_cached_prompt_tokens == 8
    assert_matches_reference(engine, [third], params[:1], later)
    bm = engine.block_manager
    assert len({bm.blocks[b].hash for b in tables[0][:2]} & set(bm.hash_to_block_ids)) == 2
    assert_all_blocks_free(bm)


def test_eos_finishes_unless_ignored(make_shadow_engine):
    engine, _ = make_shadow_engine()
    rng = random.Random(4)
    prompts = random_prompts(rng, 40)
    stop = [SamplingParams(temperature=0, max_tokens=60) for _ in prompts]
    outputs = engine.generate(prompts, stop)
    assert any(o.finish_reason.value == "stop" and o.token_ids[-1] == EOS for o in outputs)
    assert_matches_reference(engine, prompts, stop, outputs)


class FaultyPlanner(RecordingExecutor):
    """Corrupts plans the way a buggy scheduler would, to prove the shadow notices."""

    def __init__(self, inner: ShadowExecutor, fault: str) -> None:
        super().__init__(inner)
        self.fault = fault

    def step(self, plan: StepPlan) -> StepResult:
        for r in plan.new_requests:
            if self.fault == "block_table" and len(r.block_table) > 1:
                r.block_table[:] = list(reversed(r.block_table))
            if self.fault == "phantom_prefix_hit" and r.num_computed_tokens == 0 and len(r.token_ids) > 8:
                r.num_computed_tokens = 4
                r.num_scheduled_tokens -= 4
            if self.fault == "lost_completion_token" and len(r.token_ids) > 6 and r.request_id == 0:
                r.token_ids[-1] = (r.token_ids[-1] + 1) % 50
        return super().step(plan)


@pytest.mark.parametrize("fault", ["block_table", "phantom_prefix_hit", "lost_completion_token"])
def test_shadow_executor_exposes_scheduler_mistakes(fault):
    executor = FaultyPlanner(ShadowExecutor(16, 4, 50, (EOS,)), fault)
    engine = Engine(executor, SchedulerConfig(8, 64))
    rng = random.Random(5)
    prompts = random_prompts(rng, 6, lo=9, hi=16)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    outputs = engine.generate(prompts, params)
    with pytest.raises(AssertionError, match="diverged"):
        assert_matches_reference(engine, prompts, params, outputs)
    assert_all_blocks_free(engine.block_manager)


def test_rejected_plan_leaves_executor_state_unchanged():
    executor = ShadowExecutor(8, 4, 50, (EOS,))
    engine = Engine(executor, SchedulerConfig(8, 64))
    seq = engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    before = ({k: (list(v.token_ids), list(v.block_table), v.num_computed_tokens)
               for k, v in executor.table.requests.items()}, executor.kv.copy())
    bad_plans = {
        "FAILED_PRECONDITION": StepPlan(cached_requests=CachedRequests(
            request_ids=[99], num_computed_tokens=[5], num_scheduled_tokens=[1], num_new_blocks=[0])),
        "INVALID_ARGUMENT": StepPlan(
            finished_request_ids=[seq.seq_id],
            new_requests=[NewRequest(request_id=7, token_ids=[1, 2], block_table=[8], num_scheduled_tokens=2)]),
    }
    for code, plan in bad_plans.items():
        with pytest.raises(PlanError) as err:
            executor.step(plan)
        assert err.value.code == code
        after = ({k: (list(v.token_ids), list(v.block_table), v.num_computed_tokens)
                  for k, v in executor.table.requests.items()}, executor.kv)
        assert after[0] == before[0] and (after[1] == before[1]).all()
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert len(executor.table) == 0
    assert_all_blocks_free(engine.block_manager)


def two_held_requests() -> ShadowExecutor:
    """A shadow executor holding requests 1 and 2, each with a prefilled 5-token prompt (6 tokens, 5 computed)."""
    executor = ShadowExecutor(8, 4, 50, (EOS,))
    executor.step(StepPlan(is_prefill=True, new_requests=[
        NewRequest(request_id=rid, token_ids=[rid, 2, 3, 4, 5], block_table=[2 * rid - 2, 2 * rid - 1],
                      num_scheduled_tokens=5)
        for rid in (1, 2)
    ]))
    return executor


def held_state(executor: ShadowExecutor) -> tuple[dict[int, tuple[list[int], list[int], int]], list[int]]:
    """Everything a plan may change: each request's tokens, block table and computed count, and the KV."""
    requests = {k: (list(v.token_ids), list(v.block_table), v.num_computed_tokens)
                for k, v in executor.table.requests.items()}
    return requests, executor.kv.tolist()


def decode(request_ids: list[int], computed: list[int]) -> CachedRequests:
    n = len(request_ids)
    return CachedRequests(request_ids=request_ids, num_computed_tokens=computed, num_scheduled_tokens=[1] * n,
                             num_new_blocks=[0] * n)


NEW_3 = NewRequest(request_id=3, token_ids=[1, 2], block_table=[4], num_scheduled_tokens=2)
# Each plan and the request it names twice.
NAMED_TWICE = {
    "finished twice": (StepPlan(finished_request_ids=[1, 1]), 1),
    "finished twice among others": (StepPlan(finished_request_ids=[2, 1, 2]), 2),
    "finished and cached": (StepPlan(finished_request_ids=[1], cached_requests=decode([1, 2], [5, 5])), 1),
    "cached twice": (StepPlan(cached_requests=decode([1, 2, 1], [5, 5, 5])), 1),
    "new twice": (StepPlan(is_prefill=True, new_requests=[NEW_3, NEW_3]), 3),
    "new and cached": (StepPlan(new_requests=[NEW_3], cached_requests=decode([3], [2])), 3),
}


@pytest.mark.parametrize("why", NAMED_TWICE)
def test_a_plan_naming_a_request_twice_is_refused_whole(why: str):
    plan, named_twice = NAMED_TWICE[why]
    executor = two_held_requests()
    before = held_state(executor)
    with pytest.raises(PlanError) as err:
        executor.step(plan)
    assert err.value.code == "INVALID_ARGUMENT", why
    assert str(err.value).startswith(f"request {named_twice} "), err.value
    assert held_state(executor) == before, why
    # Still serving: the decode the refused plan did not run gives the tokens of a never-refused executor.
    untouched = two_held_requests()
    assert executor.step(StepPlan(cached_requests=decode([1, 2], [5, 5]))).token_ids == untouched.step(
        StepPlan(cached_requests=decode([1, 2], [5, 5]))).token_ids


def test_a_finished_request_may_come_back_as_new_in_the_same_plan():
    executor = two_held_requests()
    recompute = NewRequest(request_id=1, token_ids=[1, 2, 3, 4, 5], block_table=[4, 5], num_scheduled_tokens=5)
    result = executor.step(StepPlan(is_prefill=True, finished_request_ids=[1], new_requests=[recompute]))
    assert list(result.token_ids) == [two_held_requests().table.requests[1].token_ids[-1]]
    assert executor.table.requests[1].block_table == [4, 5] and len(executor.table) == 2


def test_a_plan_past_the_maximum_length_is_refused_whole():
    """It used to pass validation and fail in the model's rotary lookup, half-applied (UNKNOWN over gRPC)."""
    executor = ShadowExecutor(8, 4, 50, (EOS,), max_model_len=6)
    executor.step(StepPlan(is_prefill=True, new_requests=[
        NewRequest(request_id=1, token_ids=[1, 2, 3, 4, 5], block_table=[0, 1], num_scheduled_tokens=5)]))
    too_long = NewRequest(request_id=2, token_ids=list(range(1, 8)), block_table=[2, 3], num_scheduled_tokens=7)
    executor.step(StepPlan(cached_requests=decode([1], [5])))
    before = held_state(executor)
    plans = {
        "new": StepPlan(is_prefill=True, new_requests=[too_long]),
        "cached": StepPlan(cached_requests=decode([1], [6])),
    }
    for why, plan in plans.items():
        with pytest.raises(PlanError, match="maximum length 6") as err:
            executor.step(plan)
        assert err.value.code == "INVALID_ARGUMENT", why
        assert held_state(executor) == before, why


def test_over_grpc_a_plan_naming_a_request_twice_is_invalid_argument_and_changes_nothing():
    executor = two_held_requests()
    before = held_state(executor)
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExecutorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Step(pb.StepPlan(finished_request_ids=[2, 2]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request 2" in err.value.details()
            assert held_state(executor) == before
            assert stub.Reset(pb.ResetRequest(), timeout=10).num_dropped_requests == 2
    finally:
        server.stop(None)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_tiny_blocks_decode_across_block_boundaries(block_size):
    engine, _ = recording_engine(num_blocks=200, block_size=block_size)
    rng = random.Random(6)
    prompts = random_prompts(rng, 5, lo=1, hi=7)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True) for _ in prompts]
    assert_matches_reference(engine, prompts, params, engine.generate(prompts, params))
    assert_all_blocks_free(engine.block_manager)


def computed_ends(plan: StepPlan) -> dict[int, int]:
    """The context length each request reaches in ``plan``."""
    ends = {r.request_id: r.num_computed_tokens + r.num_scheduled_tokens for r in plan.new_requests}
    cached = plan.cached_requests
    for rid, computed, scheduled in zip(
        cached.request_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, strict=True
    ):
        ends[rid] = computed + scheduled
    return ends


def test_overlap_keeps_a_step_in_flight_and_outputs_unchanged():
    executor = RecordingExecutor(ShadowExecutor(64, 4, 50, (EOS,)))
    engine = Engine(executor, SchedulerConfig(8, 64), overlap=True)
    rng = random.Random(8)
    prompts = random_prompts(rng, 8, lo=3, hi=12)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 15), ignore_eos=True) for _ in prompts]
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.step()
    assert engine._in_flight is not None, "the next step is launched before this one is collected"
    while engine.has_unfinished():
        engine.step()
    engine.step()
    for prompt, p, seq in zip(prompts, params, seqs, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, p)
    limits = {seq.seq_id: len(p) + sp.max_tokens - 1 for seq, p, sp in zip(seqs, prompts, params, strict=True)}
    for plan in executor.plans:
        for rid, end in computed_ends(plan).items():
            assert end <= limits[rid], "a sequence whose last token was in flight was scheduled again"
    assert len(executor.table) == 0
    assert_all_blocks_free(engine.block_manager)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_multi_step_decode_sends_fewer_plans_and_outputs_are_unchanged(overlap):
    executor = RecordingExecutor(ShadowExecutor(40, 4, 50, (EOS,), max_model_len=40))
    engine = Engine(executor, SchedulerConfig(8, 64, num_scheduler_steps=6), overlap=overlap)
    rng = random.Random(11)
    prompts = random_prompts(rng, 10, lo=2, hi=30)
    # EOS stops some inside a plan, the 40-token model length caps others.
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=i % 3 == 0)
              for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    assert_matches_reference(engine, prompts, params, outputs)
    assert any(out.finish_reason.value == "stop" and len(out.token_ids) % 6 for out in outputs)
    decode_plans = [p for p in executor.plans if not p.is_prefill and p.cached_requests.request_ids]
    steps = [list(p.cached_requests.num_decode_steps) for p in decode_plans]
    assert max(max(s, default=1) for s in steps) == 6
    assert all(not s or len(s) == len(p.cached_requests.request_ids) for s, p in zip(steps, decode_plans, strict=True))
    decode_tokens = sum(len(out.token_ids) - 1 for out in outputs)
    assert len(decode_plans) < decode_tokens / 6 + len(prompts), "multi-step should need few decode plans"
    assert len(executor.table) == 0
    assert_all_blocks_free(engine.block_manager)


@pytest.mark.parametrize(("overlap", "num_steps", "num_blocks"), [(True, 1, 48), (False, 4, 24), (True, 4, 24)],
                         ids=["overlap", "multi-step", "multi-step-overlap"])
def test_over_grpc_with_preemption(overlap, num_steps, num_blocks):
    executor = ShadowExecutor(num_blocks, 4, 50, (EOS,))
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    remote = RemoteExecutor(f"127.0.0.1:{port}")
    try:
        engine = Engine(remote, SchedulerConfig(6, 32, num_scheduler_steps=num_steps), overlap=overlap)
        rng = random.Random(9)
        prompts = random_prompts(rng, 12, lo=2, hi=25)
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30)) for _ in prompts]
        outputs = engine.generate(prompts, params)
        assert_matches_reference(engine, prompts, params, outputs)
        assert engine.scheduler.num_preemptions > 0
        assert len(executor.table) == 0
        assert_all_blocks_free(engine.block_manager)
    finally:
        remote.close()
        server.stop(None)


def test_mixed_policy_preempting_beside_a_chunked_prompt_still_finishes():
    """A decode that runs out of blocks beside a prompt part-way through its chunks (which holds all its prompt's
    blocks) waits behind that prompt: queued ahead of it, both would wait for each other forever."""
    engine = Engine(ShadowExecutor(4, 4, 50, (EOS,)), SchedulerConfig(4, 4, 1, "mixed"))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    prompts = [[1, 2, 3], list(range(5, 17))]
    first = engine.add_request(prompts[0], params[0])
    engine.step()  # the first prompt runs; the second arrives while it decodes and is chunked beside it
    second = engine.add_request(prompts[1], params[1])
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert [first.completion_token_ids, second.completion_token_ids] == \
        [expected(engine, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    assert_all_blocks_free(engine.block_manager)


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_logprobs_across_prefill_chunks_are_those_of_the_prompt(top: int) -> None:
    engine, _ = recording_engine(max_num_batched_tokens=8)
    rng = random.Random(7)
    prompts = random_prompts(rng, 3, lo=12, hi=20)
    prompts[1][5] = next_token(np.array(prompts[1][:5]), 50, None)  # one prompt token the model predicts
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=top)
    seqs = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
    for seq, prompt in zip(seqs, prompts, strict=True):
        got = [(lp.logprob, list(lp.top_token_ids)) for lp in seq.prompt_logprobs]
        assert got == shadow_prompt_logprobs(prompt, 50, top)
    assert seqs[1].prompt_logprobs[4].logprob == pytest.approx(math.log(HIT))
    assert_all_blocks_free(engine.block_manager)
