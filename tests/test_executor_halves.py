"""A step in two halves: the next plan is applied and packed while the step before runs, with the same tokens."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan, StepResult
from executor_svc.core.request_table import PlanError
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_model_parity import random_prompts

KV_BYTES = 4 << 20
PROMPTS = {1: [5, 9, 77, 300, 41, 8], 2: [19, 23, 100, 7]}


def tiny(folder: Path) -> ModelExecutor:
    return ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), block_size=8, kv_cache_memory=KV_BYTES,
                                         threads=1))


def prefill(step_id: int) -> StepPlan:
    seeded = SamplingSettings(temperature=1.0, seed=7)  # a seeded sample depends on the token's position too
    new = [NewRequest(request_id=rid, token_ids=tokens, sampling=seeded, block_table=[rid * 4 + i for i in range(4)],
                         num_scheduled_tokens=len(tokens)) for rid, tokens in PROMPTS.items()]
    return StepPlan(step_id=step_id, is_prefill=True, new_requests=new)


def decode(step_id: int, after: int, steps: int = 1) -> StepPlan:
    """Every request's decode step once ``after`` tokens have been sampled for it."""
    rids = list(PROMPTS)
    cached = CachedRequests(request_ids=rids, num_computed_tokens=[len(PROMPTS[r]) + after - 1 for r in rids],
                               num_scheduled_tokens=[1] * len(rids), num_new_blocks=[0] * len(rids),
                               num_decode_steps=[steps] * len(rids) if steps > 1 else [])
    return StepPlan(step_id=step_id, cached_requests=cached)


def plans() -> list[StepPlan]:
    """Prefill, a 3-step decode, then single decodes: each plan can be applied before the one before runs."""
    return [prefill(1), decode(2, 1, steps=3), decode(3, 4), decode(4, 5), decode(5, 6)]


def tokens(results: list[StepResult]) -> list[list[int]]:
    return [list(r.token_ids) for r in results]


def test_each_plan_prepared_before_the_one_before_runs_samples_the_same_tokens(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    in_turn = tiny(tiny_model_folders["llama"])
    expected = [in_turn.step(plan) for plan in plans()]
    ahead = tiny(tiny_model_folders["llama"])
    ahead.launches_ahead = lambda inputs: True  # as on a GPU, where a launch only queues the forward pass
    prepared = [ahead.prepare(plan) for plan in plans()]  # every plan applied before any step runs
    assert prepared[3].inputs.model_input.pending, "its tokens were still to be sampled when it was packed"
    results, launched_ahead = [], []
    for i, step in enumerate(prepared):
        results.append(ahead.execute(step))
        launched_ahead += [i + 1 < len(prepared) and prepared[i + 1].launched is not None]
    assert tokens(results) == tokens(expected)
    # Each one-pass step was launched while the step before executed (the 3-step decode is launched in its turn):
    # steps 4 and 5 from the tokens of the one before, not yet recorded, step 3 once the 3-step decode recorded its.
    assert launched_ahead == [False, True, True, True, False]
    assert prepared[3].inputs.model_input.linked is not None and prepared[2].inputs.model_input.linked is None
    held = ahead.table.requests
    assert {rid: held[rid].token_ids for rid in held} == {rid: in_turn.table.requests[rid].token_ids for rid in held}


def test_a_plan_refused_ahead_leaves_the_step_before_and_the_table_as_they_were(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    executor = tiny(tiny_model_folders["llama"])
    first, second = executor.prepare(prefill(1)), executor.prepare(decode(2, 1))
    with pytest.raises(PlanError, match="executor has 7"):
        executor.prepare(decode(3, 1))  # says 6 tokens computed for request 1; the steps applied leave 7
    executor.execute(first)
    assert len(executor.execute(second).token_ids) == 2
    assert executor.prepare(decode(3, 2)).chunks, "the next plan in turn is still accepted"


def test_a_stale_step_never_launches_a_step_prepared_after_another(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    """A step left over from before a reset (its stream was cancelled mid-prepare) still runs after the reset; the
    step a new stream prepares meanwhile waits for another step's tokens, and must not be launched from its."""
    executor = tiny(tiny_model_folders["llama"])
    executor.launches_ahead = lambda inputs: True
    stale = executor.prepare(prefill(1))
    executor.reset()
    fresh = executor.prepare(prefill(1))
    finish, prepared = executor.finish, []

    def finish_while_the_next_plan_is_prepared(launched: object) -> object:
        prepared.append(executor.prepare(decode(2, 1)))  # as the reader thread does during the device's work
        return finish(launched)

    executor.finish = finish_while_the_next_plan_is_prepared
    executor.execute(stale)
    following = prepared[0]
    assert following.follows is fresh and following.launched is None


def test_a_step_run_is_let_go_of(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    """Each step knows the step prepared before it only until it runs: a server's steps must not pile up."""
    executor = tiny(tiny_model_folders["llama"])
    refs = []
    for plan in plans():
        step = executor.prepare(plan)
        executor.execute(step)
        refs.append(weakref.ref(step))
        del step
    gc.collect()
    assert [ref() is None for ref in refs] == [True] * (len(refs) - 1) + [False], "only the last is still known"


def generate_with_overlap_as_in_turn(folder: Path, executor: ModelExecutor, plans_ahead: int = 1) -> None:
    """Six greedy requests through an in-process engine with overlap on ``executor`` (an executor of ``folder``):
    the tokens of one that runs each step in its turn, and every block free after."""
    prompts = random_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) for i in range(len(prompts))]
    in_turn = Engine(tiny(folder)).generate(prompts, params)
    executor.prepares_ahead = True  # as on a GPU, where the CPU waits for the device
    engine = Engine(executor, overlap=True, plans_ahead=plans_ahead)
    overlapped = engine.generate(prompts, params)
    assert [c.token_ids for c in overlapped] == [c.token_ids for c in in_turn]
    assert_all_blocks_free(engine.scheduler.block_manager)


def test_an_in_process_engine_with_overlap_prepares_ahead_and_keeps_every_token(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    executor = tiny(tiny_model_folders["qwen2"])
    assert not executor.prepares_ahead, "on the CPU the forward has every core: nothing runs beside it"
    executor.launches_ahead = lambda inputs: True  # and a launch only queues the forward pass
    generate_with_overlap_as_in_turn(tiny_model_folders["qwen2"], executor)


def test_a_multi_step_decode_that_does_not_start_at_the_last_token_is_refused(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    executor = tiny(tiny_model_folders["llama"])
    chunked = NewRequest(request_id=1, token_ids=PROMPTS[1], sampling=SamplingSettings(temperature=0),
                            block_table=[0, 1, 2, 3], num_scheduled_tokens=2)
    executor.step(StepPlan(step_id=1, is_prefill=True, new_requests=[chunked]))
    mid_prompt = CachedRequests(request_ids=[1], num_computed_tokens=[2], num_scheduled_tokens=[1],
                                   num_new_blocks=[0], num_decode_steps=[3])
    with pytest.raises(PlanError, match="must start at its last token"):
        executor.step(StepPlan(step_id=2, cached_requests=mid_prompt))


def booked_on(plan: StepPlan, window: int) -> StepPlan:
    """``plan`` sent before the result of ``window``, counting on every pass of it (windows pipelined)."""
    plan.after_whole_step_id = window
    return plan


def test_a_plan_booked_on_a_window_waits_for_it_and_so_does_every_plan_behind_it(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    in_turn = tiny(tiny_model_folders["llama"])
    expected = [in_turn.step(plan) for plan in (prefill(1), decode(2, 1, steps=3), decode(3, 4, steps=3), decode(4, 7))]
    ahead = tiny(tiny_model_folders["llama"])
    ahead.launches_ahead = lambda inputs: True
    sent = [prefill(1), decode(2, 1, steps=3), booked_on(decode(3, 4, steps=3), 2), decode(4, 7)]
    prepared = [ahead.prepare(plan) for plan in sent]  # all before any runs, as a stream's reader thread may
    assert [step.deferred is not None for step in prepared] == [False, False, True, True]
    results = [ahead.execute(step) for step in prepared]
    assert tokens(results) == tokens(expected)
    assert not any(r.num_passes is not None for r in results)


def test_a_bad_plan_booked_on_a_window_is_refused_in_its_own_turn_and_the_window_answers(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    in_turn = tiny(tiny_model_folders["llama"])
    expected = [in_turn.step(plan) for plan in (prefill(1), decode(2, 1, steps=3), decode(3, 4))]
    ahead = tiny(tiny_model_folders["llama"])
    ahead.launches_ahead = lambda inputs: True
    # The booked plan says 5 tokens sampled where the window leaves 4: applied as the window's last pass runs.
    first, window, bad = (ahead.prepare(plan) for plan in (prefill(1), decode(2, 1, steps=3),
                                                            booked_on(decode(3, 5), 2)))
    assert tokens([ahead.execute(first), ahead.execute(window)]) == tokens(expected[:2])
    with pytest.raises(PlanError, match="executor has"):
        ahead.execute(bad)
    assert tokens([ahead.step(decode(4, 4))]) == tokens(expected[2:]), "the table is as the window left it"


def test_a_plan_booked_on_a_window_that_was_cut_is_dropped_unapplied(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    in_turn = tiny(tiny_model_folders["llama"])
    window = [in_turn.step(plan) for plan in (prefill(1), decode(2, 1, steps=3))][1]
    executor = tiny(tiny_model_folders["llama"])
    prepared = [executor.prepare(plan) for plan in (prefill(1), decode(2, 1, steps=3),
                                                    booked_on(decode(3, 4, steps=3), 2))]
    executor.cut(3)  # the later window named: the one before it, still to run, is cut too
    first, cut, dropped = (executor.execute(step) for step in prepared)
    assert cut.num_passes == 1 and len(cut.token_ids) == 2
    assert dropped.num_passes is not None and dropped.num_passes == 0 and not dropped.token_ids
    after_cut = executor.step(decode(4, 2))  # planned again from the one pass that ran
    assert list(after_cut.token_ids) == [window.token_ids[1], window.token_ids[4]], "seeded: the same positions"
