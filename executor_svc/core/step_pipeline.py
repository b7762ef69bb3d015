"""A plan's forward passes, shared by every executor's step code.

One pass computes and samples every scheduled chunk. With multi-step decode a
plan asks for several per request: each pass is fed the tokens the one before
sampled, from the device where it can take them there, else once the request
table has recorded them, so the table itself only validates, applies and records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult, TokenLogprobs
from executor_svc.core.request_table import PlanError, RequestTable, ScheduledChunk

# Computes and samples one token per chunk, in order (0 for a chunk that does not sample), from the input
# the executor packed for them ahead (None, as ``run_forward_passes`` passes: packed now); a verification chunk
# (``ScheduledChunk.num_drafts``) gets its accepted proposals and one more, counted in ``num_sampled_tokens``.
ForwardPass = Callable[[list[ScheduledChunk], object | None], StepResult]


@dataclass
class PreparedStep:
    """A plan applied to the request table, with its input packed when it is a single pass."""

    step_id: int
    chunks: list[ScheduledChunk]
    inputs: object | None = None
    # Every chunk is one pass (no multi-step decode): known here, so ``execute`` need not walk the chunks again.
    single: bool = False
    # The step prepared just before it: the one whose sampled tokens its input may still wait for.
    follows: PreparedStep | None = None
    # Its forward pass, started on the device by ``TableExecutor.launch`` as soon as the step before it was computed
    # (None: not started yet, or finished).
    launched: object | None = None
    # Its plan while not applied yet: one booked on a multi-step plan's every pass (``after_whole_step_id``), or queued
    # behind one, is applied once the plans before it ran (or during that plan's last pass), or dropped if it was cut.
    deferred: StepPlan | None = None


class Passes(Protocol):
    """How a multi-step plan's passes reach the device: ``TableExecutor``'s methods of the same names."""

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> object | None: ...

    def launch(self, chunks: list[ScheduledChunk], inputs: object | None = None,
               sampled_before: list[int] | None = None, behind: object | None = None) -> object: ...

    def finish(self, launched: object) -> StepResult: ...

    def launches_ahead(self, inputs: object | None) -> bool: ...

    def fills_ahead(self, inputs: object | None) -> bool: ...

    def samples_ahead(self, launched: object) -> bool: ...


@dataclass
class Synchronous:
    """``Passes`` for a plain ``ForwardPass``: each pass computed when it is launched, its input packed then."""

    forward: ForwardPass

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> None:
        return None

    def launch(self, chunks: list[ScheduledChunk], inputs: object | None = None,
               sampled_before: list[int] | None = None) -> StepResult:
        return self.forward(chunks, inputs)

    def finish(self, launched: StepResult) -> StepResult:
        return launched

    def launches_ahead(self, inputs: object | None) -> bool:
        return False

    def fills_ahead(self, inputs: object | None) -> bool:
        return False

    def samples_ahead(self, launched: object) -> bool:
        return False


def run_forward_passes(table: RequestTable, chunks: list[ScheduledChunk], forward: ForwardPass) -> StepResult:
    """Run ``forward`` over the chunks once per decode step they ask for, recording its tokens in ``table``.

    Tokens come back chunk after chunk in plan order, each chunk's in the order sampled; the passes' times add up.
    """
    if not chunks:
        return StepResult()
    if all(chunk.num_steps == 1 for chunk in chunks):
        output = forward(chunks, None)
        table.record_sampled(chunks, output.token_ids, output.num_sampled_tokens)
        return output
    return run_multi_step(table, chunks, Synchronous(forward), lambda: False)


# Told a plan's last pass once it is on the device (nothing can cut the plan any more); returns what launches the
# next plan's first pass from that pass's sampled tokens, before they are recorded (None: it waits its turn).
LastPass = Callable[[list[ScheduledChunk]], Callable[[list[int]], None] | None]


def run_multi_step(table: RequestTable, chunks: list[ScheduledChunk], passes: Passes, cut: Callable[[], bool],
                   inputs: object | None = None, launched: object | None = None,
                   last_pass: LastPass | None = None) -> StepResult:
    """The passes of a plan in which some chunk decodes more than one token; a chunk drops out after its last.

    Each pass after the first is packed while the device computes the one before, and launched from that one's
    tokens as soon as they are back where its launch only queues work (``launches_ahead``, ``fills_ahead``), or
    behind it before it is waited for where it samples on the device (``samples_ahead``): what
    ``TableExecutor.execute`` does across plans, within one. The first pass may come packed (``inputs``) or
    already on the device (``launched``); ``last_pass`` may start the next plan's first pass the same way. ``cut``
    is asked before each pass but the first; cut after ``done`` passes, each request has computed and sampled what
    those gave it, and the table plans from there: the scheduler settles as many (``StepResult.num_passes``) and
    plans the next step on them.
    """
    if not chunks:  # a plan that only drops requests
        return StepResult()
    token_ids: list[list[int]] = [[] for _ in chunks]
    logprobs: list[list[TokenLogprobs | None]] = [[] for _ in chunks]
    total = StepResult()
    asked = False
    active = list(range(len(chunks)))
    current = chunks
    if launched is None:
        launched = passes.launch(current, passes.pack(current) if inputs is None else inputs)
    done = 0
    start_next = None
    while launched is not None:
        done += 1
        staying = [i for i in active if chunks[i].num_steps > done]
        upcoming = [ScheduledChunk(chunks[i].state, chunks[i].start + done, 1) for i in staying]
        stop = bool(staying) and cut()
        inputs = passes.pack(upcoming, current) if staying and not stop else None
        ahead = inputs is not None and passes.launches_ahead(inputs) and passes.fills_ahead(inputs)
        behind = passes.launch(upcoming, inputs, behind=launched) if ahead and passes.samples_ahead(launched) else None
        if not staying and last_pass is not None:
            start_next = last_pass(current)
        output = passes.finish(launched)
        launched = behind  # a cut asked from here on stops the plan after it, the pass now in progress
        if start_next is not None:
            start_next(output.token_ids)
        # Asked again: the pass just finished was the one in progress, unless one was launched behind it.
        stop = stop or (behind is None and bool(staying) and cut())
        if ahead and not stop and launched is None:
            launched = passes.launch(upcoming, inputs, output.token_ids)
        table.record_sampled(current, output.token_ids)
        total.forward_ms += output.forward_ms
        total.sample_ms += output.sample_ms
        asked = asked or bool(output.logprobs)
        step_logprobs = output.logprobs or [None] * len(current)
        for i, token_id, entry in zip(active, output.token_ids, step_logprobs, strict=True):
            token_ids[i].append(token_id)
            logprobs[i].append(entry)
        if stop:
            total.num_passes = done
            for i in staying:
                state = chunks[i].state
                state.planned_computed, state.planned_len = state.num_computed_tokens, len(state.token_ids)
            break
        if staying and launched is None:
            launched = passes.launch(upcoming, inputs)
        active, current = staying, upcoming
    total.token_ids = [token_id for tokens in token_ids for token_id in tokens]
    if asked:
        total.logprobs = [entry for entries in logprobs for entry in entries]
    return total


class TableExecutor(Executor, ABC):
    """The executor contract for an executor whose requests live in a ``RequestTable``: the model's, the
    shadow-KV test's and the simulated accelerator's differ only in ``forward`` (or ``launch`` and ``finish``) and
    ``pack``.

    A step is two halves, so that a caller can run them on two threads (where ``prepares_ahead``), as the
    servicer's StepStream does:
    ``prepare`` applies the plan and packs the input, and needs only the plans before it to be applied;
    ``execute`` runs and records it, after the step before it. While the device computes step N, step N+1
    is applied and packed; only the tokens N samples are put in at the start of N+1 (vLLM's async
    scheduling keeps them on the device; here they are a few ints).

    ``execute`` launches step N+1's forward pass as soon as N's tokens are back, when N+1 is prepared by then
    and its launch only queues work on the device (``launches_ahead``: on a GPU, a decode step replayed from
    CUDA graphs): from N's tokens themselves where N+1's input can take them (``fills_ahead``), else once they
    are recorded. Recording them, building N's result and the caller's hand-over of it (to gRPC, or to the
    engine's thread) then run while the device computes N+1 (W5, ``bench.overlap``). An error launching N+1
    fails step N; the scheduler recomputes both, as after any failed step.

    A plan booked on every pass of the multi-step plan before it (``after_whole_step_id``) cannot be applied
    before that plan is known to run whole: ``prepare`` queues it unapplied, with every plan after it, and it is
    applied during that plan's last pass (``_start_booked``) and launched from its tokens as above, or dropped
    unapplied in its turn if a cut stopped that plan early.
    """

    info: ExecutorInfo
    table: RequestTable
    # Whether callers should prepare a plan beside the step before. Not where that step is a forward on the CPU:
    # it keeps every core busy, and work beside it stalls the OpenMP team (W1's split loses throughput).
    prepares_ahead: bool = True

    def __init__(self) -> None:
        # Steps prepared and not executed yet, in order (prepare appends from one thread, execute pops on another).
        self._queued: deque[PreparedStep] = deque()
        # The step prepared last: the one whose sampled tokens the next step's input waits for.
        self._last_prepared: PreparedStep | None = None
        # The step queued last: while it waits to be applied (``PreparedStep.deferred``), so does every plan after it.
        self._last_queued: PreparedStep | None = None
        # The latest step CutStep asked to stop early, with every one before it (set from a gRPC thread; read between
        # the passes of a multi-step plan).
        self._cut_step_id: int | None = None
        # The last multi-step plan that a cut stopped early: the plans booked on its every pass are dropped.
        self._cut_short_step_id: int | None = None

    def get_info(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> int:
        self._queued.clear()
        self._last_prepared = self._last_queued = self._cut_step_id = self._cut_short_step_id = None
        return self.table.reset()

    def cut(self, step_id: int) -> None:
        """CutStep: the multi-step plan ``step_id``, or one before it still running, stops after the pass in progress,
        or after its first if it has not started (the call may overtake its plan). Advisory: a plan applied after it
        counts on all its passes, so then it runs whole (a plan booked on them, ``after_whole_step_id``, is applied
        only once they ran)."""
        self._cut_step_id = step_id

    def _is_cut(self, prepared: PreparedStep) -> bool:
        cut = self._cut_step_id
        return cut is not None and prepared.step_id <= cut and self._last_prepared is prepared

    def step(self, plan: StepPlan) -> StepResult:
        return self.execute(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        behind = self._last_queued
        prepared = PreparedStep(plan.step_id, [])
        if plan.after_whole_step_id is not None or (behind is not None and behind.deferred is not None):
            prepared.deferred = plan  # applied once the plans before it ran, by ``execute``
        else:
            self._apply(prepared, plan)
        self._queued.append(prepared)
        self._last_queued = prepared
        return prepared

    def _apply(self, prepared: PreparedStep, plan: StepPlan, last_pass: list[ScheduledChunk] | None = None) -> None:
        """Apply ``plan`` and pack the step's input where it is one pass, or its first pass when ``last_pass`` (the
        chunks of the pass before it, whose sampled tokens its input is linked to)."""
        chunks = self.table.apply(plan)
        single = bool(chunks) and all(chunk.num_steps == 1 for chunk in chunks)
        before = self._last_prepared
        inputs = None
        if last_pass is not None and chunks:
            inputs = self.pack(chunks, last_pass)
        elif single:
            inputs = self.pack(chunks, before.chunks if before is not None and before.single else None)
        prepared.chunks, prepared.inputs, prepared.single, prepared.follows = chunks, inputs, single, before
        self._last_prepared = prepared
        prepared.deferred = None  # last: from here on ``prepare`` (maybe on another thread) applies the next plan

    def execute(self, prepared: PreparedStep) -> StepResult:
        while self._queued:  # steps prepared before it and never run are dropped
            if self._queued.popleft() is prepared:
                break
        prepared.follows = None  # no chain of every step run so far
        if prepared.deferred is not None:  # the plans before it have run by now
            plan = prepared.deferred
            if plan.after_whole_step_id is not None and plan.after_whole_step_id == self._cut_short_step_id:
                prepared.deferred = None
                return StepResult(num_passes=0, instance_id=self.info.instance_id, step_id=prepared.step_id)
            self._apply(prepared, plan)
        if prepared.single:
            launched, prepared.launched = prepared.launched, None  # its device buffers go once finished
            if launched is None:
                launched = self.launch(prepared.chunks, prepared.inputs)
            queued = self._following(prepared)
            if queued is not None and self.fills_ahead(queued.inputs) and self.samples_ahead(launched):
                queued.launched = self.launch(queued.chunks, queued.inputs, behind=launched)
            output = self.finish(launched)
            following = self._following(prepared)  # prepared meanwhile, or not launched behind it
            # After a verification a request's tokens are not one per chunk: the next step takes them recorded.
            if following is not None and self.fills_ahead(following.inputs) and not output.num_sampled_tokens:
                following.launched = self.launch(following.chunks, following.inputs, output.token_ids)
                following = None
            self.table.record_sampled(prepared.chunks, output.token_ids, output.num_sampled_tokens)
        else:
            inputs, launched, prepared.inputs, prepared.launched = prepared.inputs, prepared.launched, None, None
            output = run_multi_step(self.table, prepared.chunks, self, lambda: self._is_cut(prepared), inputs, launched,
                                    lambda last: self._start_booked(prepared, last))
            if output.num_passes is not None:
                self._cut_short_step_id = prepared.step_id
            following = self._following(prepared)
        if following is not None:
            following.launched = self.launch(following.chunks, following.inputs)
        output.instance_id, output.step_id = self.info.instance_id, prepared.step_id
        return output

    def _start_booked(self, window: PreparedStep, last: list[ScheduledChunk]) -> Callable[[list[int]], None] | None:
        """``window``'s last pass is on the device: the plan booked on its every pass, next in the queue, is applied
        and packed now, and its first pass launched from that pass's tokens where that only queues work, so that the
        device does not sit idle between two plans (W5, ``bench.overlap``)."""
        try:
            following = self._queued[0]
        except IndexError:
            return None
        plan = following.deferred
        if plan is None or plan.after_whole_step_id != window.step_id:
            return None
        try:
            self._apply(following, plan, last)
        except PlanError:  # refused in its own turn, not as the window's answer (a refused plan changes nothing)
            return None
        if not (self.launches_ahead(following.inputs) and self.fills_ahead(following.inputs)):
            return None

        def start(sampled: list[int]) -> None:
            following.launched = self.launch(following.chunks, following.inputs, sampled)

        return start

    def _following(self, prepared: PreparedStep) -> PreparedStep | None:
        """The step prepared right after ``prepared``, when it is next to run, one pass, not launched yet, and its
        launch does not wait for the device (only this thread takes from the queue, so a step seen there stays)."""
        try:
            following = self._queued[0]
        except IndexError:
            return None
        if following.follows is not prepared or not following.single or following.launched is not None:
            return None
        return following if self.launches_ahead(following.inputs) else None

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> object | None:
        """The step's input, built ahead of ``forward`` (None: ``forward`` reads the chunks when it runs); ``before``:
        the chunks of the step before where its tokens are still to come, for ``fills_ahead``."""
        return None

    def launches_ahead(self, inputs: object | None) -> bool:
        """Whether ``launch`` returns before the device has computed ``inputs`` (a GPU's queued kernels), so that the
        step is worth launching before the one before is recorded; else (the CPU computes it in ``launch``, or
        a host sync would) it is launched in its own turn, not in the step before's."""
        return False

    def fills_ahead(self, inputs: object | None) -> bool:
        """Whether ``inputs`` can be launched from the step before's sampled tokens before they are recorded."""
        return False

    def samples_ahead(self, launched: object) -> bool:
        """Whether ``launched`` samples its tokens on the device, where the step after it (where ``fills_ahead``)
        takes them: that step is then launched behind it (``launch``'s ``behind``) before it is waited for, and the
        device never waits for the host between the two."""
        return False

    @abstractmethod
    def forward(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepResult:
        """Compute and sample one token per chunk, in order (0 for a chunk short of its end), a verification chunk's
        accepted proposals and one more: a ``ForwardPass``."""

    def launch(self, chunks: list[ScheduledChunk], inputs: object | None = None,
               sampled_before: list[int] | None = None, behind: object | None = None) -> object:
        """Start ``forward`` on the device without waiting for it. The tokens the step before sampled are recorded,
        or given as ``sampled_before`` (where ``fills_ahead``), or still on the device in ``behind``, that step
        launched and not waited for (where it ``samples_ahead``). Here nothing starts before ``finish``: an executor
        with a device to wait for overrides both."""
        return chunks, inputs

    def finish(self, launched: object) -> StepResult:
        """Wait for a launched forward pass and sample: what ``forward`` returns."""
        return self.forward(*launched)
