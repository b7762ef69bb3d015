"""The requests the engine loop has admitted, their choices, the outputs waiting to be delivered, and what the
metrics need to know of them: token counts, and each choice's times, told to the ``LoopObserver``."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.outputs import OutputProcessor, RequestOutput, RequestUsage
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.scheduler import TokenOutput
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.engine.admission import Admission
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.stats import LoopObserver


@dataclass(eq=False)
class RequestHandle:
    """A submitted request; ``sink`` is whatever the caller's ``deliver`` needs to reach it."""

    prepared: PreparedRequest
    sink: object
    # When the caller's request arrived (time.monotonic, before it was tokenized) and when it was queued.
    arrived_at: float
    # Tokens of a choice its reader takes at a time (inf: whole completions): each choice's ``max_decode_steps``.
    tokens_per_read: float = 1
    # What its reader takes at a time when more than ``tokens_per_read``, as the API process's pacing says.
    paced_reading: float = 1
    queued_at: float = field(default_factory=time.monotonic)
    # Set by the loop thread once the request no longer counts against the queue limits.
    dequeued: bool = False
    # Choices (of n) not started yet: they start once choice 0's prompt is computed, to share its KV blocks.
    pending_choices: list[int] = field(default_factory=list)
    # The LoRA adapter id choice 0 took: the others run through it too, though it was unloaded since.
    lora_id: int = 0
    # Choice 0's arrival (``Sequence.arrival``): the others rank by it among requests of their priority.
    arrival: int | None = None

    @property
    def reads_at_a_time(self) -> float:
        """What its reader takes at a time, its choices' ``max_decode_steps``."""
        return max(self.tokens_per_read, self.paced_reading)


@dataclass
class Active:
    """Loop-thread state of one admitted choice of a request."""

    handle: RequestHandle
    seq: Sequence
    processor: OutputProcessor
    # When its last tokens came out (time.monotonic); None before the first.
    last_token_at: float | None = None


class LiveRequests:
    """Loop-thread only: admitted choices by request and by sequence id, the outbox, finish and token counts."""

    def __init__(self, admission: Admission, observer: LoopObserver) -> None:
        self.admission = admission
        self.observer = observer
        self.by_handle: dict[RequestHandle, list[Active]] = {}
        self.by_seq_id: dict[int, Active] = {}
        self.outbox: list[tuple[RequestHandle, RequestOutput]] = []
        self.finished: dict[FinishReason, int] = dict.fromkeys(FinishReason, 0)
        # Choices an engine-side failure ended (``fail``): vLLM's finish reason "error", not counted in ``finished``.
        self.num_failed = 0
        # Prompts of the choices whose first token is out, tokens sent. Each choice counts its prompt, as vLLM's n
        # child requests each do (counter and histogram alike), though usage counts it once per request.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Admitted choices whose outputs may end their sequence (stop strings), and requests whose other choices
        # start once their outputs come: while both are 0, processing outputs never changes the next plan.
        self._stop_string_choices = 0
        self._pending_requests = 0

    @property
    def outputs_leave_plans_alone(self) -> bool:
        """Processing a step's outputs cannot change the plan after it (``EngineLoop._launch_ahead``)."""
        return not (self._stop_string_choices or self._pending_requests)

    def brings_a_first_token(self, outputs: list[TokenOutput]) -> bool:
        """Whether ``outputs`` hold a choice's first token since it was admitted (a resumed one's first new token)."""
        by_seq_id = self.by_seq_id
        return any(by_seq_id[out.seq.seq_id].last_token_at is None for out in outputs)

    def handle_of(self, seq: Sequence) -> RequestHandle:
        """The request an admitted choice belongs to."""
        return self.by_seq_id[seq.seq_id].handle

    def __len__(self) -> int:
        return len(self.by_handle)

    def start(self, engine: Engine, handle: RequestHandle, index: int, tokenizer: ModelTokenizer | None) -> None:
        """Queue choice ``index`` of the request in the engine (InvalidRequest if the cache shrank since)."""
        prepared = handle.prepared
        params = prepared.params.for_choice(index)
        resumed = prepared.resumed_token_ids
        processor = OutputProcessor(tokenizer, prepared.prompt_token_ids, params, index, resumed)
        started = self.by_handle.get(handle)  # choice 0's id, renumbered with it after an executor restart
        lora = (started[0].seq.lora_id if started else handle.lora_id) if index else prepared.lora
        seq = engine.enqueue(prepared.prompt_token_ids, params, resumed, lora, speculate=prepared.params.n == 1,
                             priority=prepared.priority, arrival=handle.arrival if index else None,
                             cache_salt=prepared.cache_salt)
        handle.arrival = seq.arrival
        handle.lora_id = seq.lora_id
        seq.max_decode_steps = handle.reads_at_a_time
        active = Active(handle, seq, processor)
        self.by_handle.setdefault(handle, []).append(active)
        self.by_seq_id[seq.seq_id] = active
        self._stop_string_choices += bool(params.stop)
        if index == 0:
            handle.pending_choices = list(range(1, prepared.params.n))
            self._pending_requests += bool(handle.pending_choices)

    def set_reading(self, handles: list[RequestHandle], tokens: float) -> None:
        """``handles``' readers take ``tokens`` at a time: so many decode steps a plan may compute for their choices."""
        for handle in handles:
            handle.paced_reading = tokens
            for active in self.by_handle.get(handle, ()):
                active.seq.max_decode_steps = handle.reads_at_a_time

    def start_pending(self, engine: Engine, handle: RequestHandle, tokenizer: ModelTokenizer | None) -> None:
        """Choice 0's prompt is computed: the other choices start, and hit its blocks in the prefix cache."""
        pending, handle.pending_choices = handle.pending_choices, []
        self._pending_requests -= 1
        for index in pending:
            self.start(engine, handle, index, tokenizer)
        engine.cut_for_queued()

    def process(self, engine: Engine, outputs: list[TokenOutput], tokenizer: ModelTokenizer | None) -> None:
        """A step's tokens: each choice's output queued, the sequences a stop string ended stopped, finished choices
        forgotten. Inter-token gaps are told grouped by when each choice's previous tokens came out: in a decode
        step nearly every choice shares that time, so the observer is called once or twice a step, not per choice.
        This runs for every choice every step on the thread that plans the next one, so the per-choice work is a
        few list and attribute operations (``emit`` inlined)."""
        now = time.monotonic()
        previous: list[float] = []
        generated = 0
        by_seq_id, outbox = self.by_seq_id, self.outbox
        for out in outputs:
            active = by_seq_id[out.seq.seq_id]
            handle = active.handle
            if handle.pending_choices:
                self.start_pending(engine, handle, tokenizer)
            output, stop_at = active.processor.process(out)
            if stop_at is not None:
                engine.stop_at(active.seq, stop_at)
            if not handle.dequeued:
                self.dequeue(handle)
            outbox.append((handle, output))
            generated += len(output.token_ids)
            last = active.last_token_at
            active.last_token_at = now
            if last is None:
                self.observer.first_token(now - handle.arrived_at)
                self.num_prompt_tokens += active.seq.num_prompt_tokens
            else:
                previous.append(last)
            if output.finish_reason is not None:
                self.forget(active, output.finish_reason)
        self.num_generation_tokens += generated
        for last, count in Counter(previous).items():
            self.observer.inter_tokens(now - last, count)

    def emit(self, handle: RequestHandle, output: RequestOutput) -> None:
        """Queue ``output`` for delivery; the request stops counting against the queue limits."""
        self.dequeue(handle)
        self.outbox.append((handle, output))

    def dequeue(self, handle: RequestHandle) -> None:
        if not handle.dequeued:
            handle.dequeued = True
            self.admission.release(len(handle.prepared.prompt_token_ids))

    def forget(self, active: Active, reason: FinishReason, failed: bool = False) -> None:
        """The choice is done (its last output emitted, or it was aborted; ``failed``: by an engine-side failure)."""
        handle = active.handle
        choices = self.by_handle[handle]
        choices.remove(active)
        if not choices and not handle.pending_choices:
            del self.by_handle[handle]
        seq = active.seq
        del self.by_seq_id[seq.seq_id]
        self._stop_string_choices -= bool(seq.params.stop)
        self._count_end(reason, failed)
        self.dequeue(handle)
        queued_s = None if seq.scheduled_at is None else seq.scheduled_at - handle.queued_at
        self.observer.finished(time.monotonic() - handle.arrived_at, queued_s, seq.num_prompt_tokens,
                               seq.num_completion_tokens)

    def _count_end(self, reason: FinishReason, failed: bool) -> None:
        if failed:
            self.num_failed += 1
        else:
            self.finished[reason] += 1

    def cancel(self, engine: Engine, handle: RequestHandle, answer: bool = False, drained: bool = False,
               failed: bool = False) -> None:
        """Abort every choice of the request and free its blocks now; with ``answer`` each ends with ABORT, its
        usage and the text it held back (an Abort call; ``drained``: the server shuts down), else silently (the
        caller went away, or ``failed``: an engine-side failure ended it). A request done is left alone."""
        for active in list(self.by_handle.get(handle, ())):
            engine.abort(active.seq)
            if answer:
                index = active.processor.index
                usage = RequestUsage.of(active.seq, counts_prompt=index == 0)
                # Held-back text is final once no token follows; a drained stream keeps it for its resumption,
                # whose first response brings it.
                text = "" if drained else active.processor.release()
                self.emit(handle, RequestOutput(text, finish_reason=FinishReason.ABORT, usage=usage, index=index,
                                                drained=drained))
            self.forget(active, FinishReason.ABORT, failed)
        if handle.pending_choices:
            ended_s = time.monotonic() - handle.arrived_at
            for index in handle.pending_choices:
                if answer:
                    self.emit(handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=RequestUsage(0, 0, 0),
                                                    index=index, drained=drained))
                self._count_end(FinishReason.ABORT, failed)
                self.observer.finished(ended_s, None, len(handle.prepared.prompt_token_ids), 0)
            handle.pending_choices = []
            self._pending_requests -= 1
            self.by_handle.pop(handle, None)

    def refuse(self, handle: RequestHandle, answer: bool = True, drained: bool = True) -> None:
        """A request never started (the server drains, or a pause held it): each of its choices ends with ABORT,
        the prompt counted once; without ``answer`` (its caller went away) it only stops counting as queued."""
        if not answer:
            self.dequeue(handle)
            return
        num_prompt_tokens = len(handle.prepared.prompt_token_ids)
        for index in range(handle.prepared.params.n):
            usage = RequestUsage(num_prompt_tokens if index == 0 else 0, 0, 0)
            self.emit(handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=usage, index=index,
                                            drained=drained))

    def fail(self, engine: Engine, handle: RequestHandle, error: RequestFailed) -> None:
        """End the request with ``error``: one error answers the caller, its other choices stop too. Every caller
        is an engine-side failure (the executor failing or gone, a bug, a restart that lost what the request
        needs), so its choices count as finish reason "error", not as a client's abort."""
        self.emit(handle, RequestOutput(error=error))
        self.cancel(engine, handle, failed=True)

    def end_all(self, engine: Engine, error: RequestFailed | None = None, drained: bool = True) -> int:
        """Abort every request and free its blocks: answered with ``error``, or each choice with ABORT (``drained``:
        the server drains, and a client may resume the stream elsewhere; else a pause aborted it)."""
        handles = list(self.by_handle)
        for handle in handles:
            if error is None:
                self.cancel(engine, handle, answer=True, drained=drained)
            else:
                self.fail(engine, handle, error)
        return len(handles)

    def take_outbox(self) -> list[tuple[RequestHandle, RequestOutput]]:
        outbox, self.outbox = self.outbox, []
        return outbox
