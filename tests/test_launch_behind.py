"""A decode step's tokens taken on the device at launch, and the next step launched behind it before the host waits:
the device goes from step to step without the host in between, and every token stays the same."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan, StepResult
from executor_svc.fakes.simulated import parse_args, simulated_executor
from executor_svc.runtime.model_executor import ModelExecutor
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_executor_halves import PROMPTS, generate_with_overlap_as_in_turn, tiny

GREEDY = SamplingSettings(temperature=0.0)
SEEDED = SamplingSettings(temperature=1.0, top_k=20, seed=7)
UNSEEDED = SamplingSettings(temperature=0.8, min_p=0.05)  # drawn from the sampler's own generator
# Each needs the host: the penalty the tokens recorded, the logprobs a read of the logits.
PENALIZED = SamplingSettings(temperature=0.0, repetition_penalty=1.3)
WITH_LOGPROBS = SamplingSettings(temperature=0.0, num_logprobs=2)


def prefill(sampling: dict[int, SamplingSettings]) -> StepPlan:
    new = [NewRequest(request_id=rid, token_ids=tokens, sampling=sampling[rid],
                      block_table=[rid * 4 + i for i in range(4)], num_scheduled_tokens=len(tokens))
           for rid, tokens in PROMPTS.items()]
    return StepPlan(step_id=1, is_prefill=True, new_requests=new)


def decode(step_id: int, after: int, rids: tuple[int, ...] = (1, 2), steps: int = 1) -> StepPlan:
    """A decode step of ``rids`` once ``after`` tokens have been sampled for each (``steps`` passes)."""
    cached = CachedRequests(request_ids=list(rids), num_computed_tokens=[len(PROMPTS[r]) + after - 1 for r in rids],
                            num_scheduled_tokens=[1] * len(rids), num_new_blocks=[0] * len(rids),
                            num_decode_steps=[steps] * len(rids) if steps > 1 else [])
    return StepPlan(step_id=step_id, cached_requests=cached)


def plans(sampling: dict[int, SamplingSettings]) -> list[StepPlan]:
    # The fourth decodes request 1 alone, so the fifth takes its tokens by index, not whole and in order.
    return [prefill(sampling), decode(2, 1), decode(3, 2), decode(4, 3, rids=(1,)), decode(5, 4, rids=(1,))]


def windows(sampling: dict[int, SamplingSettings]) -> list[StepPlan]:
    return [prefill(sampling), decode(2, 1, steps=3), decode(3, 4), decode(4, 5, steps=2)]


def as_on_a_gpu(executor: ModelExecutor) -> list[bool]:
    """Every decode step of ``executor`` (on the CPU) launched as if it only queued work; returns, per launch,
    whether it was launched behind a step not waited for yet."""
    executor.runner.launches_async = lambda model_input: not model_input.meta.is_prefill
    launch, launched_behind = executor.launch, []

    def noting(chunks, inputs=None, sampled_before=None, behind=None):
        launched_behind.append(behind is not None)
        return launch(chunks, inputs, sampled_before, behind)

    executor.launch = noting
    return launched_behind


def tokens(results: list[StepResult]) -> list[list[int]]:
    return [list(r.token_ids) for r in results]


def run_ahead_and_in_turn(folder: Path, sampling: dict[int, SamplingSettings], sent=plans) -> list[bool]:
    """``sent(sampling)`` on an executor whose decode launches only queue work, every plan prepared before any step
    runs (as a step stream's reader thread may), then executed in turn: the tokens and the table of one that runs
    each plan in its turn; returns, per launch, whether it was launched behind the step (or pass) before."""
    in_turn, executor = tiny(folder), tiny(folder)
    in_turn.runner.sampler.seed = executor.runner.sampler.seed = 0  # unseeded rows: the same generator in both
    expected = [in_turn.step(plan) for plan in sent(sampling)]
    launched_behind = as_on_a_gpu(executor)
    prepared = [executor.prepare(plan) for plan in sent(sampling)]
    assert tokens([executor.execute(step) for step in prepared]) == tokens(expected)
    held = executor.table.requests
    assert {rid: held[rid].token_ids for rid in held} == {rid: in_turn.table.requests[rid].token_ids for rid in held}
    return launched_behind


def test_greedy_decode_steps_are_launched_behind_the_step_before_with_the_same_tokens(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    behind = run_ahead_and_in_turn(tiny_model_folders["llama"], {1: GREEDY, 2: GREEDY})
    # The prefill samples on the host; the first decode is launched from its tokens once they are back; each decode
    # after it is launched behind the decode before, whose tokens it takes where they were sampled.
    assert behind == [False, False, True, True, True]


def test_steps_that_draw_are_launched_behind_the_step_before_with_the_same_draws(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    """A seeded row's draw depends on its seed and position only; an unseeded one's on the sampler's generator, which
    the draws queued at each launch take in the order the host's would."""
    assert run_ahead_and_in_turn(tiny_model_folders["llama"], {1: UNSEEDED, 2: SEEDED}) == [False, False, True, True,
                                                                                             True]


@pytest.mark.parametrize("sampling", [{1: GREEDY, 2: GREEDY}, {1: UNSEEDED, 2: SEEDED}], ids=["greedy", "drawn"])
def test_the_passes_of_a_multi_step_plan_are_launched_behind_each_other_with_the_same_tokens(
    tiny_model_folders: dict[str, Path], sampling: dict[int, SamplingSettings],  # noqa: F811
) -> None:
    # A window's first pass is launched in its turn (its plan is applied then), its next passes behind it; the plan
    # after a window is launched once the window's tokens are recorded.
    behind = run_ahead_and_in_turn(tiny_model_folders["llama"], sampling, windows)
    assert behind == [False, False, True, True, False, False, True]


def test_a_cut_while_a_pass_is_queued_behind_the_one_waited_for_stops_after_the_queued_one(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    """CutStep stops a plan after the pass in progress: once a pass is queued behind the one waited for, that is the
    queued one. The table then plans from its tokens, and the plan that follows them is taken."""
    greedy = {1: GREEDY, 2: GREEDY}
    uncut = tiny(tiny_model_folders["llama"])
    whole = [uncut.step(plan) for plan in windows(greedy)[:2]][1]
    executor = tiny(tiny_model_folders["llama"])
    as_on_a_gpu(executor)
    executor.step(windows(greedy)[0])
    finish = executor.finish

    def cut_during_the_first_wait(launched: object) -> object:
        executor.cut(2)
        executor.finish = finish
        return finish(launched)

    executor.finish = cut_during_the_first_wait
    result = executor.step(decode(2, 1, steps=3))
    assert result.num_passes == 2
    # Two tokens of each request, as the whole plan's first two (its tokens come request after request).
    assert list(result.token_ids) == [t for rid in range(2) for t in list(whole.token_ids)[rid * 3: rid * 3 + 2]]
    assert executor.step(decode(3, 3)).token_ids, "the plan from after the two passes is taken"


@pytest.mark.parametrize("host_row", [PENALIZED, WITH_LOGPROBS], ids=["penalty", "logprobs"])
def test_a_step_with_a_row_that_needs_the_host_is_waited_for_before_the_next_launches(
    tiny_model_folders: dict[str, Path], host_row: SamplingSettings,  # noqa: F811
) -> None:
    # Request 1 alone from the fourth step on: the greedy fourth step has the fifth launched behind it.
    assert run_ahead_and_in_turn(tiny_model_folders["llama"], {1: GREEDY, 2: host_row}) == [False] * 4 + [True]


def test_an_engine_with_steps_launched_behind_keeps_every_token_and_frees_every_block(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    executor = tiny(tiny_model_folders["qwen2"])
    behind = as_on_a_gpu(executor)
    generate_with_overlap_as_in_turn(tiny_model_folders["qwen2"], executor, plans_ahead=2)
    assert sum(behind) > 0, "some decode step was launched behind the one before"


def simulated_steps(sampling: SamplingSettings, host_late_s: float) -> list[tuple[float, float]]:
    """Two decode steps on the simulated device, the host waking ``host_late_s`` after the first ends; each step's
    time on the device (start, end)."""
    simulated = simulated_executor(parse_args(["--step-ms", "5", "--num-blocks", "64", "--block-size", "8",
                                               "--vocab-size", "500", "--eos-token-ids", "0"]))
    simulated.step(prefill({1: sampling, 2: sampling}))
    first, second = simulated.prepare(decode(2, 1)), simulated.prepare(decode(3, 2))
    finish, on_device = simulated.finish, []

    def late(launched):
        time.sleep(max(0.0, launched.done_at - time.perf_counter()) + host_late_s)
        on_device.append((launched.done_at - simulated.step_s, launched.done_at))
        return finish(launched)

    simulated.finish = late
    simulated.execute(first)
    simulated.execute(second)
    return on_device


def test_on_the_simulated_device_a_step_sampled_there_runs_right_after_the_one_before_however_late_the_host():
    (_, first_end), (second_start, _) = simulated_steps(GREEDY, host_late_s=0.003)
    assert second_start == first_end
    (_, first_end), (second_start, _) = simulated_steps(PENALIZED, host_late_s=0.003)
    assert second_start >= first_end + 0.003, "a penalised step's tokens come from the host: the device waits for it"


def test_a_step_prepared_while_the_one_before_is_waited_for_is_launched_from_its_tokens(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    """Not there to be launched behind the step before, it is launched as soon as that step's tokens are back, before
    they are recorded, as without sampling on the device."""
    greedy = {1: GREEDY, 2: GREEDY}
    in_turn = tiny(tiny_model_folders["llama"])
    expected = [in_turn.step(plan) for plan in plans(greedy)]
    executor = tiny(tiny_model_folders["llama"])
    launched_behind = as_on_a_gpu(executor)
    sent, finish, prepared = plans(greedy), executor.finish, []

    def finish_while_the_next_plan_is_prepared(launched: object) -> object:
        if len(prepared) < len(sent):
            prepared.append(executor.prepare(sent[len(prepared)]))  # as the reader thread does meanwhile
        return finish(launched)

    executor.finish = finish_while_the_next_plan_is_prepared
    prepared.append(executor.prepare(sent[0]))
    results, launched_ahead = [], []
    for i in range(len(sent)):
        results.append(executor.execute(prepared[i]))
        launched_ahead.append(i + 1 < len(prepared) and prepared[i + 1].launched is not None)
    assert tokens(results) == tokens(expected)
    assert launched_ahead == [True] * (len(sent) - 1) + [False]
    assert not any(launched_behind), "none was prepared when the step before it was launched"
