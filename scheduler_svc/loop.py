"""The engine loop: one thread owns the Engine, any number of RPCs feed it and read from it.

RPC threads only ``submit`` and ``cancel``; both append to a queue under a lock
and wake the loop. The loop thread admits new requests, applies cancellations
(freeing blocks at once), runs one engine step, turns each sampled token into
text, and hands every output of the step to ``deliver`` in one call. When there
is nothing to do it sleeps on a condition variable.

A failed step (executor gone, restarted, or a plan it refused) fails every
request in flight with UNAVAILABLE and discards the engine; the next request
reconnects through ``connect`` (which resets the executor), so a later
recovery policy only has to replace ``_fail_all``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from nanoserve.v1 import executor_pb2
from scheduler_svc.detokenizer import TextStream
from scheduler_svc.engine import Engine, TokenOutput
from scheduler_svc.requests import PreparedRequest, public_error
from scheduler_svc.sampling import InvalidRequest
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.tokenizer import ModelTokenizer

log = logging.getLogger("nanoserve.scheduler")

# Status names (grpc.StatusCode members) a request can fail with.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
UNAVAILABLE = "UNAVAILABLE"


class QueueFull(RuntimeError):
    """Too many requests wait to be scheduled; the caller should retry later."""


class LoopStopped(RuntimeError):
    """The loop is shutting down and takes no more requests."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class RequestError:
    code: str
    message: str


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request; the last one carries finish_reason and usage, or an error."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[executor_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: RequestError | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class RequestHandle:
    """A submitted request; ``sink`` is whatever the caller's ``deliver`` needs to reach it."""

    prepared: PreparedRequest
    sink: object
    # Set by the loop thread once the last output (finish or error) is on its way.
    answered: bool = False


@dataclass(frozen=True)
class LoopStats:
    num_waiting: int = 0
    num_running: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_steps: int = 0
    num_finished_stop: int = 0
    num_finished_length: int = 0
    num_aborted: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class _Active:
    """Loop-thread state of one admitted request."""

    handle: RequestHandle
    seq: Sequence
    # None without a tokenizer: then there is no text to make (and no stop strings to match).
    text: TextStream | None


@dataclass
class _Counters:
    """Totals since start, kept across engine rebuilds."""

    steps: int = 0
    finished: dict[FinishReason, int] = field(default_factory=lambda: dict.fromkeys(FinishReason, 0))
    prefix_hit_tokens: int = 0
    preemptions: int = 0


Deliver = Callable[[list[tuple[RequestHandle, RequestOutput]]], None]


def describe_failure(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"the executor failed a step ({error.code().name}: {error.details()}); retry the request"
    return f"the executor failed a step ({type(error).__name__}: {error}); retry the request"


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        connect: Callable[[], Engine],
        tokenizer: ModelTokenizer | None,
        deliver: Deliver,
        max_queued_requests: int,
    ) -> None:
        self.engine: Engine | None = engine
        self.info = engine.info
        self.connect = connect
        self.tokenizer = tokenizer
        self.deliver = deliver
        self.max_queued_requests = max_queued_requests
        self._wakeup = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._cancelled: list[RequestHandle] = []
        self._num_queued = 0
        self._stopping = False
        self._active: dict[RequestHandle, _Active] = {}
        self._by_seq_id: dict[int, _Active] = {}
        self._outbox: list[tuple[RequestHandle, RequestOutput]] = []
        self._counters = _Counters()
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # Called from any thread.

    def start(self) -> None:
        self._thread.start()

    def submit(self, prepared: PreparedRequest, sink: object) -> RequestHandle:
        """Queue a validated request; raise QueueFull or LoopStopped when it cannot be taken."""
        handle = RequestHandle(prepared, sink)
        with self._wakeup:
            if self._stopping:
                raise LoopStopped("the scheduler is shutting down")
            if self._num_queued >= self.max_queued_requests:
                raise QueueFull(f"{self._num_queued} requests are already waiting to be scheduled; retry later")
            self._num_queued += 1
            self._inbox.append(handle)
            self._wakeup.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Abort ``handle`` before the next step; a finished or unknown request is left alone."""
        with self._wakeup:
            self._cancelled.append(handle)
            self._wakeup.notify()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish every request with ABORT, tell the executor, and end the loop thread."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # The loop thread.

    def _has_work(self) -> bool:
        engine = self.engine
        return engine is not None and (engine.has_unfinished() or bool(engine.scheduler.released_seq_ids))

    def _run(self) -> None:
        busy = False
        while True:
            with self._wakeup:
                while not (busy or self._inbox or self._cancelled or self._stopping):
                    self._wakeup.wait()
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
                stopping = self._stopping
            if stopping:
                self._shutdown(inbox)
                return
            try:
                self._iterate(inbox, cancelled)
            except Exception as e:  # any failure must reach the callers, not kill the loop
                log.error("engine step failed: %s", e, exc_info=not isinstance(e, grpc.RpcError))
                self._fail_all(describe_failure(e), inbox)
            busy = self._has_work()
            self._publish()

    def _iterate(self, inbox: list[RequestHandle], cancelled: list[RequestHandle]) -> None:
        self._admit(inbox)
        self._abort(cancelled)
        if self._has_work():
            self._step()
        if self._has_work() and not self.engine.has_unfinished():
            # Idle now: answer the callers, then have the executor drop what finished (a drop-only
            # plan), so that once the stats say idle the executor holds nothing either.
            self._deliver()
            self.engine.step()

    def _admit(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            if self.engine is None and not self._reconnect(handle):
                continue
            prepared = handle.prepared
            try:
                seq = self.engine.add_request(prepared.prompt_token_ids, prepared.params)
            except InvalidRequest as e:
                self._emit(handle, RequestOutput(error=RequestError(INVALID_ARGUMENT, str(public_error(e)))))
                continue
            tokenizer = self.tokenizer
            text = TextStream(tokenizer, prepared.prompt_token_ids, prepared.params.stop) if tokenizer else None
            active = _Active(handle, seq, text)
            self._active[handle] = active
            self._by_seq_id[seq.seq_id] = active
            log.debug("request %s admitted as seq %d (%d prompt tokens)", prepared.request_id, seq.seq_id,
                      len(prepared.prompt_token_ids))

    def _reconnect(self, handle: RequestHandle) -> bool:
        """Rebuild the engine on a reset executor after a failure; fail ``handle`` if that fails too."""
        try:
            self.engine = self.connect()
        except Exception as e:  # the request must get an answer whatever went wrong
            message = f"the executor is unavailable ({e}); retry later"
            self._emit(handle, RequestOutput(error=RequestError(UNAVAILABLE, message)))
            return False
        self.info = self.engine.info
        log.info("reconnected to executor instance %s", self.info.instance_id)
        return True

    def _abort(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            active = self._active.get(handle)
            if active is None:
                continue
            self.engine.abort(active.seq)
            self._forget(active, FinishReason.ABORT)
            log.debug("request %s aborted by the client", handle.prepared.request_id)

    def _step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            active = self._by_seq_id[out.seq.seq_id]
            output = self._on_token(active, out)
            self._emit(active.handle, output)
            if output.finish_reason is not None:
                self._forget(active, output.finish_reason)

    def _on_token(self, active: _Active, out: TokenOutput) -> RequestOutput:
        """Text, stop strings and finish reason for one sampled token."""
        seq = out.seq
        text, stopped = "", False
        if active.text is not None:
            if not (seq.is_finished and seq.finish_reason is FinishReason.STOP):
                text, stopped = active.text.push(out.token_id)
            if not stopped and seq.is_finished:
                tail, stopped = active.text.finish()
                text += tail
            if stopped:
                self.engine.scheduler.finish(seq, FinishReason.STOP)
        reason = FinishReason.STOP if stopped else seq.finish_reason
        logprobs = [out.logprobs] if out.logprobs is not None and seq.params.logprobs is not None else []
        usage = self._usage(seq) if reason is not None else None
        return RequestOutput(text, [out.token_id], logprobs, reason, usage)

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        return Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_prefix_hit_tokens or 0)

    def _forget(self, active: _Active, reason: FinishReason) -> None:
        del self._active[active.handle]
        del self._by_seq_id[active.seq.seq_id]
        self._counters.finished[reason] += 1

    def _fail_all(self, message: str, inbox: list[RequestHandle]) -> None:
        """Answer every request in flight with UNAVAILABLE and drop the engine; the next request reconnects.

        Requests of this iteration's ``inbox`` that were neither admitted nor answered yet fail too.
        """
        for handle in [*self._active, *inbox]:
            if not handle.answered:
                self._emit(handle, RequestOutput(error=RequestError(UNAVAILABLE, message)))
        self._active.clear()
        self._by_seq_id.clear()
        self._retire_engine()

    def _retire_engine(self) -> None:
        if self.engine is not None:
            self._counters.steps += self.engine.num_steps
            self._counters.prefix_hit_tokens += self.engine.scheduler.num_prefix_hit_tokens
            self._counters.preemptions += self.engine.scheduler.num_preemptions
        self.engine = None

    def _shutdown(self, inbox: list[RequestHandle]) -> None:
        """Abort everything, tell the executor to drop it, and answer each caller."""
        for handle in inbox:
            usage = Usage(len(handle.prepared.prompt_token_ids), 0, 0)
            self._emit(handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=usage))
        for active in list(self._active.values()):
            self.engine.abort(active.seq)
            self._emit(active.handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=self._usage(active.seq)))
            self._forget(active, FinishReason.ABORT)
        if self._has_work():
            try:
                self.engine.step()
            except Exception as e:  # shutting down anyway; the executor is reset on the next start
                log.warning("could not tell the executor to drop aborted requests: %s", e)
        self._publish()

    def _emit(self, handle: RequestHandle, output: RequestOutput) -> None:
        handle.answered = output.is_last
        self._outbox.append((handle, output))

    def _deliver(self) -> None:
        """Hand the outputs gathered so far over in one call."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self.deliver(outbox)

    def _publish(self) -> None:
        """End of an iteration: deliver the outputs, refresh the stats and the queue count."""
        self._deliver()
        self.stats = self._snapshot()
        with self._wakeup:
            self._num_queued = len(self._inbox) + self.stats.num_waiting

    def _snapshot(self) -> LoopStats:
        c = self._counters
        engine = self.engine
        totals = dict(
            num_steps=c.steps,
            num_finished_stop=c.finished[FinishReason.STOP],
            num_finished_length=c.finished[FinishReason.LENGTH],
            num_aborted=c.finished[FinishReason.ABORT],
            num_prefix_cache_hit_tokens=c.prefix_hit_tokens,
            num_preemptions=c.preemptions,
        )
        if engine is None:
            return LoopStats(num_blocks=self.info.num_blocks, num_free_blocks=self.info.num_blocks, **totals)
        scheduler, blocks = engine.scheduler, engine.block_manager
        totals["num_steps"] += engine.num_steps
        totals["num_prefix_cache_hit_tokens"] += scheduler.num_prefix_hit_tokens
        totals["num_preemptions"] += scheduler.num_preemptions
        return LoopStats(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            **totals,
        )
