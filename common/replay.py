"""Replay a recording against any executor (docs/replay.md): the recorded plans sent again in order, each result
compared with the recorded one.

A plan is sent once its recorded outcome is read (with overlap the scheduler sent plan N+1 before result N came
back), so that a multi-step plan the scheduler cut short (its result says ``num_passes``) is sent asking for those
passes only, and a plan the executor dropped unrun (``num_passes`` 0) is not sent: the executor then holds what the
recorded one held. A recorded reset, or a handshake from a new instance (a restart), resets the executor. Plans
that got no result (a failure, or an executor that went away) are sent all the same: that is how an incident is
reproduced. A plan answered by an instance the recording has not yet shaken hands with ran on a restarted
executor (sent, with overlap, before the plan that failed): the scheduler dropped that answer, so it is not compared.

Per request the first sampled token that differs is reported with its step and position: after it the executor's
own copy of the request holds other tokens, so nothing later is compared. Where logprobs were recorded, the
largest difference of a sampled token's logprob (or a prompt token's) before the first divergence is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from common.executor import Executor
from common.recording import Recording, RecordingError
from common.step import CachedRequests, ExecutorInfo, StepPlan, StepResult
from common.step_codec import info_from_proto, plan_from_proto, result_from_proto
from nanoserve.v1 import recording_pb2 as rpb


@dataclass
class Divergence:
    """The first sampled token of a request that differs: in which plan, at which position of its sequence."""

    step_id: int
    position: int
    recorded: int
    replayed: int


@dataclass
class RequestReport:
    """One request (per session: ids restart with each scheduler) as the replay saw it."""

    session: int
    request_id: int
    # Sampled tokens compared, up to and with the first divergence.
    num_tokens: int = 0
    divergence: Divergence | None = None
    # Largest |recorded - replayed| logprob before the first divergence; None when none was recorded.
    max_logprob_diff: float | None = None

    def logprob_diff(self, recorded: float, replayed: float) -> None:
        diff = abs(recorded - replayed)
        self.max_logprob_diff = diff if self.max_logprob_diff is None else max(self.max_logprob_diff, diff)


@dataclass
class StepIssue:
    """A plan whose outcome is not a result to compare token by token. ``difference``: the replay refused a plan
    the recorded executor ran, or answered with another number of tokens. A plan the recorded executor failed
    (gone, restarted, or refusing it) is no difference whatever the replay does, only a note: the replay failing
    it too is an incident reproduced."""

    session: int
    step_id: int
    recorded: str
    replayed: str
    difference: bool = True


@dataclass
class ReplayReport:
    executor: ExecutorInfo
    recorded_executors: list[ExecutorInfo] = field(default_factory=list)
    num_sessions: int = 0
    num_plans: int = 0
    # Plans with a recorded result, their tokens compared; identical in every sampled token.
    num_compared: int = 0
    num_identical: int = 0
    # Plans the recorded executor dropped unrun (num_passes 0), not sent.
    num_dropped: int = 0
    num_restarts: int = 0
    num_resets: int = 0
    recorded_s: float = 0.0
    replay_s: float = 0.0
    requests: dict[tuple[int, int], RequestReport] = field(default_factory=dict)
    issues: list[StepIssue] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> list[RequestReport]:
        return [r for r in self.requests.values() if r.divergence is not None]

    @property
    def identical(self) -> bool:
        """Every sampled token as recorded, and no plan refused or failed that the recorded executor ran."""
        return not self.diverged and not any(issue.difference for issue in self.issues)


class ExecutorGone(RuntimeError):
    """The executor can no longer be reached: the replay stops there (a refused plan is an outcome; this is not)."""


class ReplayError(RecordingError):
    """The executor cannot take this recording's plans (another KV block size)."""


def check_executor(recorded: ExecutorInfo, info: ExecutorInfo) -> list[str]:
    """Warnings where ``info`` may not take ``recorded``'s plans; ReplayError where it cannot."""
    if info.block_size != recorded.block_size:
        raise ReplayError(f"the executor's KV blocks hold {info.block_size} tokens, the recording's "
                          f"{recorded.block_size}: its plans' block tables mean nothing to it")
    warnings = []
    for name in ("num_blocks", "vocab_size", "max_model_len"):
        if getattr(info, name) < getattr(recorded, name):
            warnings.append(f"the executor's {name} is {getattr(info, name)}, the recording's "
                            f"{getattr(recorded, name)}: plans past it are refused")
    return warnings


def cut_to(plan: StepPlan, num_passes: int) -> StepPlan:
    """A multi-step plan that asks for the passes the recorded one ran before it was cut, and no more."""
    c = plan.cached_requests
    steps = [min(n, num_passes) for n in c.num_decode_steps]
    return replace(plan, cached_requests=CachedRequests(c.request_ids, c.num_computed_tokens, c.num_scheduled_tokens,
                                                        c.num_new_blocks, c.new_block_ids, steps))


def describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


def outcome(replayed: StepResult | BaseException) -> str:
    """A sent plan's outcome in a note: it ran, or how it failed."""
    return f"failed: {describe(replayed)}" if isinstance(replayed, BaseException) else "ran"


# A result's row: (request id, position of its first sampled token, tokens it sampled).
Row = tuple[int, int, int]


@dataclass
class Pending:
    plan: StepPlan
    time_s: float


class Replayer:
    """Drives ``executor`` with a recording; ``pace``: send each plan at its recorded time, not as fast as it goes."""

    def __init__(self, executor: Executor, pace: bool = False, sleep: Callable[[float], None] = time.sleep) -> None:
        self.executor = executor
        self.pace = pace
        self.sleep = sleep
        self.report = ReplayReport(executor.get_info())
        self.session = 0
        self._pending: dict[int, Pending] = {}
        # Each held request's tokens so far, and whether it asked for logprobs: which result rows sampled.
        self._lengths: dict[int, int] = {}
        self._logprobs: set[int] = set()
        self._instance = ""
        self._started = 0.0

    def run(self, recording: Recording, progress: Callable[[int], None] = lambda n: None) -> ReplayReport:
        start = time.monotonic()
        self.executor.reset()
        for index, session in enumerate(recording.sessions):
            self.session, self._instance, self._started = index, "", time.monotonic()
            self._reset()
            last = 0.0
            for record in recording.records(session):
                self._record(record)
                last = record.time_s
                progress(1)
            self._flush()
            self.report.recorded_s += last
        self.report.num_sessions = len(recording.sessions)
        self.report.replay_s = time.monotonic() - start
        return self.report

    def _record(self, record: rpb.Record) -> None:
        entry = record.WhichOneof("entry")
        if entry == "plan":
            plan = plan_from_proto(record.plan)
            self._pending[plan.step_id] = Pending(plan, record.time_s)
            self.report.num_plans += 1
        elif entry == "result":
            self._answered(result_from_proto(record.result))
        elif entry == "failure":
            self._failed(record.failure)
        elif entry == "handshake":
            self._handshake(info_from_proto(record.handshake))
        elif entry == "reset":
            self._flush()
            self.report.num_resets += 1
            self._reset()
        else:  # end
            self._flush()

    def _handshake(self, recorded: ExecutorInfo) -> None:
        self.report.warnings += check_executor(recorded, self.report.executor)
        self.report.recorded_executors.append(recorded)
        if self._instance and recorded.instance_id != self._instance:  # restarted: it held nothing any more
            self._flush()
            self.report.num_restarts += 1
            self._reset()
        self._instance = recorded.instance_id

    def _reset(self) -> None:
        self.executor.reset()
        self._lengths.clear()
        self._logprobs.clear()

    def _before(self, step_id: int) -> Pending | None:
        """Run the plans sent before ``step_id`` that got no recorded outcome; ``step_id``'s own, taken out."""
        for earlier in [s for s in self._pending if s < step_id]:
            self._send(self._pending.pop(earlier), None)
        return self._pending.pop(step_id, None)

    def _flush(self) -> None:
        for step_id in list(self._pending):
            self._send(self._pending.pop(step_id), None)

    def _answered(self, recorded: StepResult) -> None:
        pending = self._before(recorded.step_id)
        if pending is None:  # answered after a reset it raced with: that plan ran already, unknown
            return
        if recorded.num_passes == 0:
            self.report.num_dropped += 1
            return
        if recorded.instance_id and self._instance and recorded.instance_id != self._instance:
            self._restarted_under(pending, recorded)
            return
        rows, replayed = self._send(pending, recorded)
        self.report.num_compared += 1
        if isinstance(replayed, BaseException):
            self._issue(recorded.step_id, "ran", f"refused: {describe(replayed)}")
        elif self._compare(rows, recorded, replayed):
            self.report.num_identical += 1

    def _restarted_under(self, pending: Pending, recorded: StepResult) -> None:
        """A plan sent before the one that failed (overlap) and run by the instance that came back, which held
        nothing from before: the scheduler dropped its answer on recovering, so its tokens are sent, not compared."""
        self._issue(recorded.step_id, f"ran on the restarted instance {recorded.instance_id}, answer dropped",
                    outcome(self._send(pending, recorded)[1]), difference=False)

    def _failed(self, failure: rpb.StepFailure) -> None:
        pending = self._before(failure.step_id)
        if pending is not None:
            self._issue(failure.step_id, f"failed: {failure.error}", outcome(self._send(pending, None)[1]),
                        difference=False)

    def _issue(self, step_id: int, recorded: str, replayed: str, difference: bool = True) -> None:
        self.report.issues.append(StepIssue(self.session, step_id, recorded, replayed, difference))

    def _send(self, pending: Pending, recorded: StepResult | None) -> tuple[list[Row], StepResult | BaseException]:
        """Send a plan (cut to the passes the recorded one ran); its rows, and the result or what the executor
        raised (a refused plan leaves it unchanged)."""
        plan = pending.plan
        rows = self._advance(plan, recorded)
        if self.pace:
            self.sleep(max(0.0, self._started + pending.time_s - time.monotonic()))
        sent = plan if recorded is None or recorded.num_passes is None else cut_to(plan, recorded.num_passes)
        try:
            return rows, self.executor.step(sent)
        except ExecutorGone:
            raise
        except Exception as e:
            return rows, e

    def _advance(self, plan: StepPlan, recorded: StepResult | None) -> list[Row]:
        """Follow each held request through ``plan`` as the recorded executor ran it: its result's rows, in order,
        as (request id, position of the first token it sampled, tokens sampled: 0 for a prefill chunk short of
        its prompt's end, which still fills one entry)."""
        lengths = self._lengths
        for request_id in plan.finished_request_ids:
            lengths.pop(request_id, None)
            self._logprobs.discard(request_id)
        rows = []
        for new in plan.new_requests:
            lengths[new.request_id] = len(new.token_ids)
            if new.sampling.num_logprobs is not None:
                self._logprobs.add(new.request_id)
            end = new.num_computed_tokens + new.num_scheduled_tokens
            rows.append((new.request_id, end, int(end == len(new.token_ids))))
        c = plan.cached_requests
        passes = recorded.num_passes if recorded is not None else None
        steps = c.num_decode_steps or [1] * len(c.request_ids)
        # A verification row (k proposals) computes its last token and the proposals, and samples what the recorded
        # executor says it did (num_sampled_tokens, in result order after the new requests).
        drafts = c.num_draft_tokens or [0] * len(c.request_ids)
        sampled = recorded.num_sampled_tokens if recorded is not None else []
        rows_before = len(rows)
        for i, (request_id, computed, scheduled, n, k) in enumerate(zip(
                c.request_ids, c.num_computed_tokens, c.num_scheduled_tokens, steps, drafts, strict=True)):
            end = computed + scheduled - k
            samples = end == lengths.get(request_id)  # one it does not hold: the executor refuses the plan
            if k:
                n = sampled[rows_before + i] if sampled else 1
            rows.append((request_id, end, (n if passes is None else min(n, passes)) if samples else 0))
        for request_id, _, count in rows:
            if request_id in lengths:
                lengths[request_id] += count
        return rows

    def _request(self, request_id: int) -> RequestReport:
        key = (self.session, request_id)
        report = self.report.requests.get(key)
        if report is None:
            report = self.report.requests[key] = RequestReport(self.session, request_id)
        return report

    def _compare(self, rows: list[Row], recorded: StepResult, replayed: StepResult) -> bool:
        """Compare the sampled tokens request by request; True when the plan's tokens are all the same."""
        if len(replayed.token_ids) != len(recorded.token_ids):
            self._issue(recorded.step_id, f"{len(recorded.token_ids)} tokens", f"{len(replayed.token_ids)} tokens")
            return False
        index = 0
        for request_id, position, count in rows:
            report = self._request(request_id)
            for k in range(count):
                if report.divergence is None:
                    self._token(report, request_id, recorded, replayed, index + k, position + k)
            index += count or 1
        self._prompt_logprobs(recorded, replayed)
        return replayed.token_ids == recorded.token_ids

    def _token(self, report: RequestReport, rid: int, recorded: StepResult, replayed: StepResult, i: int,
               position: int) -> None:
        report.num_tokens += 1
        want, got = recorded.token_ids[i], replayed.token_ids[i]
        if want != got:
            report.divergence = Divergence(recorded.step_id, position, want, got)
        elif rid in self._logprobs and i < len(recorded.logprobs) and i < len(replayed.logprobs):
            a, b = recorded.logprobs[i], replayed.logprobs[i]
            if a is not None and b is not None:
                report.logprob_diff(a.logprob, b.logprob)

    def _prompt_logprobs(self, recorded: StepResult, replayed: StepResult) -> None:
        runs = {(run.request_id, run.first_position): run for run in replayed.prompt_logprobs}
        for run in recorded.prompt_logprobs:
            other = runs.get((run.request_id, run.first_position))
            report = self._request(run.request_id)
            if other is None or report.divergence is not None:
                continue
            for a, b in zip(run.logprobs, other.logprobs, strict=False):
                report.logprob_diff(a.logprob, b.logprob)
