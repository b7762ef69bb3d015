"""The executor-supervision state machine, driven with made-up times: no threads, no sockets."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.engine.backoff import Backoff
from scheduler_svc.engine.supervision import IDLE_PROBE_S, MAX_FAILED_STEPS, ExecutorState, Supervisor


def test_a_serving_executor_is_probed_only_when_idle_and_quiet():
    s = Supervisor(now=100.0)
    assert s.serving and not s.probe_due(100.0 + IDLE_PROBE_S - 0.01)
    assert s.probe_due(100.0 + IDLE_PROBE_S)
    assert s.wake_at(has_work=True) is None, "work to do: no sleep at all"
    assert s.wake_at(has_work=False) == 100.0 + IDLE_PROBE_S
    s.postpone_probe(105.0)
    assert not s.probe_due(105.0 + IDLE_PROBE_S - 0.01) and s.wake_at(False) == 105.0 + IDLE_PROBE_S


def test_a_failed_step_goes_down_and_recovery_is_tried_at_once_then_with_backoff():
    s = Supervisor(now=0.0, backoff=Backoff(first_s=0.1, max_s=0.4))
    assert s.step_failed(10.0) is False
    assert s.state is ExecutorState.DOWN and not s.serving
    assert s.retry_due(10.0) and not s.probe_due(1e9), "no probes while down"
    assert s.wake_at(has_work=True) == 10.0, "down: wait for the retry even with work"
    assert [s.recovery_failed(10.0 + i) for i in range(4)] == [0.1, 0.2, 0.4, 0.4]
    assert not s.retry_due(13.3) and s.retry_due(13.4)
    s.recovered(14.0)
    assert s.serving and s.probe_due(14.0 + IDLE_PROBE_S)


def test_going_down_again_restarts_the_backoff_and_reports_only_the_first_transition():
    s = Supervisor(now=0.0, backoff=Backoff(first_s=0.1, max_s=5.0))
    assert s.go_down(1.0) is True
    s.recovery_failed(1.0)
    s.recovery_failed(1.1)
    assert s.go_down(2.0) is False, "already down: health does not flip again"
    s.recovered(3.0)
    assert s.go_down(4.0) is True
    assert s.recovery_failed(4.0) == 0.1


def test_the_same_work_failing_repeatedly_is_given_up_even_across_recoveries():
    s = Supervisor(now=0.0)
    verdicts = []
    for i in range(MAX_FAILED_STEPS):
        verdicts.append(s.step_failed(float(i)))
        s.recovered(float(i) + 0.5)
    assert verdicts == [False] * (MAX_FAILED_STEPS - 1) + [True]
    assert s.step_failed(10.0) is False, "the count starts over once it gave up"


def test_a_decode_step_clears_the_failure_count_and_a_recompute_prefill_does_not():
    s = Supervisor(now=0.0)
    s.step_succeeded(num_progress_steps=7)
    for _ in range(MAX_FAILED_STEPS - 1):
        s.step_failed(0.0)
        s.recovered(0.0)
        s.step_succeeded(num_progress_steps=7)  # the recovery's recompute: prefill only
    assert s.step_failed(1.0) is True, "the same decode failed after each recompute"
    for _ in range(MAX_FAILED_STEPS - 1):
        s.step_failed(2.0)
        s.recovered(2.0)
    s.step_succeeded(num_progress_steps=8)
    assert s.step_failed(3.0) is False, "a decode got through: the count starts over"


def test_an_incompatible_executor_keeps_requests_failing_until_the_right_one_is_back():
    s = Supervisor(now=0.0, backoff=Backoff(first_s=0.5, max_s=0.5))
    s.step_failed(1.0)
    assert s.recovered_incompatible(1.0, "serves another model") is True
    assert s.state is ExecutorState.INCOMPATIBLE and s.incompatible == "serves another model"
    assert not s.retry_due(1.4) and s.retry_due(1.5), "it is retried like a down executor"
    assert s.recovered_incompatible(1.5, "serves another model") is False, "logged once"
    s.recovery_failed(2.0)
    assert s.incompatible is not None, "unreachable in between: still not the right one"
    s.recovered(3.0)
    assert s.serving and s.incompatible is None


def test_a_resync_recovers_at_once_though_serving_and_keeps_health():
    """A recording started: the loop recovers onto the same executor, with no health flip; a failed attempt is
    retried with backoff, not in a tight loop."""
    s = Supervisor(now=0.0, backoff=Backoff(first_s=0.1, max_s=0.4))
    assert not s.retry_due(1e9)
    s.resync(5.0)
    assert s.serving and s.retry_due(5.0) and s.wake_at(has_work=False) == 5.0
    assert s.recovery_failed(5.0) == 0.1
    assert s.serving and not s.retry_due(5.05) and s.retry_due(5.1)
    s.recovered(6.0)
    assert s.serving and not s.retry_due(1e9) and s.wake_at(has_work=True) is None


def test_a_first_prefill_and_decodes_are_progress_and_a_recompute_is_not(make_scheduler: Callable[..., Scheduler]):
    """What ``Supervisor.step_succeeded`` is told: a recovery's recompute is no progress, even where its last chunk
    computes one token as a decode does (chunks of 8, 8 and 1 here)."""
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    s.add(Sequence(0, list(range(1, 10)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 4))
    gained = []

    def step() -> None:
        before = s.num_progress_steps
        seqs, is_prefill = s.schedule()
        s.postprocess(seqs, [7] * len(seqs), is_prefill)
        gained.append(s.num_progress_steps - before)

    for _ in range(9):  # the 9-token prompt's two chunks, then seven decodes: 17 tokens
        step()
    assert gained == [1, 0] + [1] * 7, "the first chunk of a first prefill, then every decode"
    s.requeue_all(BlockManager(16, 4))  # an executor restart: recompute
    for _ in range(4):
        step()
    assert gained[9:] == [0, 0, 0, 1], "the recompute's chunks of 8, 8 and 1, then a decode"
