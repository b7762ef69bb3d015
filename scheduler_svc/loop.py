"""The engine loop: one thread owns the Engine, any number of RPCs feed it and read from it.

RPC threads only ``submit`` and ``cancel``; both append to a queue under a lock
and wake the loop. The loop thread admits new requests, applies cancellations
(freeing blocks at once), runs one engine step, turns each sampled token into
text, and hands every output of the step to ``deliver`` in one call. When there
is nothing to do it sleeps on a condition variable.

A failed step (executor gone, restarted, hung past its deadline, or a plan it
refused) loses no request: the loop reports NOT_SERVING, retries with backoff
until ``Engine.recover`` succeeds, and every request carries on by recompute.
``stop`` drains: no new requests, those in flight get a grace period, the rest
end with ABORT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from nanoserve.v1 import executor_pb2
from scheduler_svc.backoff import Backoff
from scheduler_svc.detokenizer import TextStream
from scheduler_svc.engine import Engine, IncompatibleExecutor, TokenOutput
from scheduler_svc.requests import PreparedRequest, public_error
from scheduler_svc.sampling import InvalidRequest
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.tokenizer import ModelTokenizer

log = logging.getLogger("nanoserve.scheduler")

# Status names (grpc.StatusCode members) a request can fail with.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
# Steps failing one after another right after a successful recovery: the executor refuses this very work.
MAX_FAILED_STEPS = 3
# An idle loop checks the executor this often, so health turns NOT_SERVING without waiting for a request.
IDLE_PROBE_S = 2.0


class QueueFull(RuntimeError):
    """Too many requests or prompt tokens wait to be scheduled; the caller should retry later."""


class LoopStopped(RuntimeError):
    """The loop is shutting down and takes no more requests."""


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on what waits to be scheduled (not yet producing tokens); beyond them submit refuses."""

    max_requests: int = 1024
    max_tokens: int = 1 << 20


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
    # Set by the loop thread once the request no longer counts against the queue limits.
    dequeued: bool = False


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


Deliver = Callable[[list[tuple[RequestHandle, RequestOutput]]], None]
OnServing = Callable[[bool], None]


def describe_failure(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        tokenizer: ModelTokenizer | None,
        deliver: Deliver,
        limits: QueueLimits,
        on_serving: OnServing = lambda serving: None,
    ) -> None:
        """``on_serving(False)`` when the executor fails, ``on_serving(True)`` once it is back (loop thread)."""
        self.engine = engine
        self.info = engine.info
        self.tokenizer = tokenizer
        self.deliver = deliver
        self.limits = limits
        self.on_serving = on_serving
        self._wakeup = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._cancelled: list[RequestHandle] = []
        # Requests and prompt tokens counted against ``limits``: from submit until the first token or the answer.
        self._queued_requests = 0
        self._queued_tokens = 0
        self._dequeued_requests = 0
        self._dequeued_tokens = 0
        self._stopping = False
        self._drain_deadline: float | None = None
        self._active: dict[RequestHandle, _Active] = {}
        self._by_seq_id: dict[int, _Active] = {}
        self._outbox: list[tuple[RequestHandle, RequestOutput]] = []
        self._finished: dict[FinishReason, int] = dict.fromkeys(FinishReason, 0)
        # Executor outage: set while the loop waits for the executor to come back.
        self._down = False
        self._retry_at = 0.0
        self._probe_at = time.monotonic() + IDLE_PROBE_S
        self._backoff = Backoff()
        self._incompatible: str | None = None
        self._failed_steps = 0
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # Called from any thread.

    def start(self) -> None:
        self._thread.start()

    def submit(self, prepared: PreparedRequest, sink: object) -> RequestHandle:
        """Queue a validated request; raise QueueFull, LoopStopped or InvalidRequest when it cannot be taken."""
        handle = RequestHandle(prepared, sink)
        n = len(prepared.prompt_token_ids)
        limits = self.limits
        if n > limits.max_tokens:
            raise InvalidRequest("prompt", f"{n} tokens is more than this server queues at once "
                                           f"(--max-queued-tokens {limits.max_tokens})")
        with self._wakeup:
            if self._stopping:
                raise LoopStopped("the scheduler is shutting down; retry on another replica or later")
            if self._queued_requests >= limits.max_requests:
                raise QueueFull(f"{self._queued_requests} requests are already waiting to be scheduled "
                                f"(--max-queued-requests {limits.max_requests}); retry later")
            if self._queued_tokens + n > limits.max_tokens:
                raise QueueFull(f"{self._queued_tokens} prompt tokens are already waiting to be scheduled and "
                                f"{n} more would pass --max-queued-tokens {limits.max_tokens}; retry later")
            self._queued_requests += 1
            self._queued_tokens += n
            self._inbox.append(handle)
            self._wakeup.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Abort ``handle`` before the next step; a finished or unknown request is left alone."""
        with self._wakeup:
            self._cancelled.append(handle)
            self._wakeup.notify()

    def stop(self, grace_s: float = 0.0, join_timeout_s: float | None = None) -> None:
        """Take no more requests, let those in flight finish for ``grace_s`` seconds, abort the rest, end the thread.

        Blocks until the loop thread ended, or ``join_timeout_s`` passed.
        """
        with self._wakeup:
            if not self._stopping:
                self._stopping = True
                self._drain_deadline = time.monotonic() + grace_s
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(join_timeout_s)

    # The loop thread.

    def _has_work(self) -> bool:
        engine = self.engine
        return engine.has_unfinished() or bool(engine.scheduler.released_seq_ids)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                self._wait()
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
            try:
                self._admit(inbox)
                self._abort(cancelled)
                if self._down:
                    if time.monotonic() >= self._retry_at:
                        self._recover()
                elif self._has_work():
                    self._step()
                elif time.monotonic() >= self._probe_at:
                    self._probe()
            except Exception as e:  # a bug in the loop: answer every caller, then start over on a reset executor
                log.exception("engine loop failed: %s", e)
                self._fail_all(INTERNAL, f"internal scheduler error ({type(e).__name__}); retry the request")
                self._go_down()
            if self._drained():
                self._shutdown()
                return
            self._publish()

    def _wait(self) -> None:
        """Sleep (lock held) until there is work: requests, cancels, a step, a retry, a probe, the drain's end."""
        while not (self._inbox or self._cancelled):
            wake_at = []
            if self._down:
                wake_at.append(self._retry_at)
            elif self._has_work():
                return
            else:
                wake_at.append(self._probe_at)
            if self._drain_deadline is not None:
                if not self._active:
                    return
                wake_at.append(self._drain_deadline)
            timeout = min(wake_at) - time.monotonic()
            if timeout <= 0:
                return
            self._wakeup.wait(timeout)

    def _drained(self) -> bool:
        """Stopping, and either nothing is left in flight or the grace period is over."""
        with self._wakeup:
            if self._drain_deadline is None:
                return False
            return time.monotonic() >= self._drain_deadline or not (self._active or self._inbox)

    def _admit(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            prepared = handle.prepared
            if self._incompatible is not None:
                self._emit(handle, RequestOutput(error=RequestError(UNAVAILABLE, self._incompatible)))
                continue
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

    def _abort(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            active = self._active.get(handle)
            if active is None:
                continue
            self.engine.abort(active.seq)
            self._forget(active, FinishReason.ABORT)
            log.debug("request %s aborted by the client", handle.prepared.request_id)

    def _step(self) -> None:
        """One engine step; then, once idle, a drop-only plan so that idle stats mean an empty executor too."""
        outputs = self._executor_step()
        if outputs is None:
            return
        for out in outputs:
            active = self._by_seq_id[out.seq.seq_id]
            output = self._on_token(active, out)
            self._emit(active.handle, output)
            if output.finish_reason is not None:
                self._forget(active, output.finish_reason)
        if self._has_work() and not self.engine.has_unfinished():
            self._deliver()
            self._executor_step()

    def _executor_step(self) -> list[TokenOutput] | None:
        """``Engine.step``; None when the executor failed it (the loop then waits for the executor)."""
        try:
            outputs = self.engine.step()
        except Exception as e:  # gone, restarted, past --step-timeout, or it refused the plan
            self._step_failed(e)
            return None
        self._failed_steps = 0
        return outputs

    def _step_failed(self, error: Exception) -> None:
        self._failed_steps += 1
        reason = describe_failure(error)
        log.warning("executor step failed (%s); %d requests wait for it to come back", reason, len(self._active))
        if self._failed_steps >= MAX_FAILED_STEPS:
            log.error("the executor failed the same work %d times in a row; failing the requests in flight",
                      self._failed_steps)
            self._failed_steps = 0
            self._fail_all(INTERNAL, f"the executor keeps failing this work ({reason}); retry the request")
        self._go_down()

    def _probe(self) -> None:
        """Idle: is the executor still there, and still the same instance?"""
        try:
            info = self.engine.executor.get_info()
        except Exception as e:  # gone or hung: as if a step had failed
            log.warning("executor unreachable while idle (%s)", describe_failure(e))
            self._go_down()
            return
        if info.instance_id != self.info.instance_id:
            log.warning("executor restarted while idle (instance %s)", info.instance_id)
            self._go_down()

    def _go_down(self) -> None:
        """Report NOT_SERVING and try to recover at once, then with backoff."""
        if not self._down:
            self._down = True
            self._backoff.reset()
            self.on_serving(False)
        self._retry_at = time.monotonic()

    def _recover(self) -> None:
        """One attempt to carry on with the executor: handshake, reset, requeue every request for recompute."""
        try:
            dropped = self.engine.recover()
        except IncompatibleExecutor as e:
            if self._incompatible is None:
                log.error("%s; requests fail with UNAVAILABLE until the right executor is back", e)
            self._incompatible = f"{e}; requests cannot carry over"
            self._fail_all(UNAVAILABLE, self._incompatible)
            self._retry_at = time.monotonic() + self._backoff.next()
            return
        except Exception as e:  # the executor is still down, or hung: retry later
            delay = self._backoff.next()
            log.warning("executor not back (%s); retrying in %.1fs", describe_failure(e), delay)
            self._retry_at = time.monotonic() + delay
            return
        self._down, self._incompatible = False, None
        self.info = self.engine.info
        for seq in dropped:
            active = self._by_seq_id[seq.seq_id]
            message = (f"the restarted executor's KV cache ({self.info.num_blocks} blocks) is too small for this "
                       "request; retry with a shorter prompt or max_tokens")
            self._emit(active.handle, RequestOutput(error=RequestError(RESOURCE_EXHAUSTED, message)))
            self._forget(active, FinishReason.ABORT)
        log.info("executor instance %s is back: %d requests resume by recompute, %d too large for it",
                 self.info.instance_id, len(self._active), len(dropped))
        self.on_serving(True)

    def _on_token(self, active: _Active, out: TokenOutput) -> RequestOutput:
        """Text, stop strings and finish reason for the tokens one step sampled for a request."""
        seq, token_ids = out.seq, out.token_ids
        text, stopped = "", False
        if active.text is not None:
            last = len(token_ids) - 1
            for k, token_id in enumerate(token_ids):
                if k == last and out.final and seq.finish_reason is FinishReason.STOP:
                    break  # an EOS or stop token ends the text without being part of it
                piece, stopped = active.text.push(token_id)
                text += piece
                if stopped:
                    if k < last or not out.final:
                        self.engine.stop_at(seq, out.position + k)
                    token_ids = token_ids[: k + 1]
                    break
            if not stopped and out.final:
                tail, stopped = active.text.finish()
                text += tail
        reason = FinishReason.STOP if stopped else (seq.finish_reason if out.final else None)
        logprobs = out.logprobs[: len(token_ids)] if out.logprobs and seq.params.logprobs is not None else []
        usage = self._usage(seq) if reason is not None else None
        return RequestOutput(text, token_ids, logprobs, reason, usage)

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        return Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_prefix_hit_tokens or 0)

    def _forget(self, active: _Active, reason: FinishReason) -> None:
        del self._active[active.handle]
        del self._by_seq_id[active.seq.seq_id]
        self._finished[reason] += 1
        self._dequeue(active.handle)

    def _fail_all(self, code: str, message: str) -> None:
        """Answer every request in flight with ``code`` and free its blocks."""
        for active in list(self._active.values()):
            self.engine.abort(active.seq)
            self._emit(active.handle, RequestOutput(error=RequestError(code, message)))
            self._forget(active, FinishReason.ABORT)

    def _shutdown(self) -> None:
        """The grace period is over: abort what is left, tell the executor to drop it, answer each caller."""
        with self._wakeup:
            leftover, self._inbox = self._inbox, []
        for handle in leftover:
            usage = Usage(len(handle.prepared.prompt_token_ids), 0, 0)
            self._emit(handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=usage))
        num_aborted = len(self._active) + len(leftover)
        for active in list(self._active.values()):
            self.engine.abort(active.seq)
            self._emit(active.handle, RequestOutput(finish_reason=FinishReason.ABORT, usage=self._usage(active.seq)))
            self._forget(active, FinishReason.ABORT)
        if num_aborted:
            log.warning("shutdown grace period over: %d requests aborted", num_aborted)
        if not self._down and self._has_work():
            try:
                self.engine.step()
            except Exception as e:  # shutting down anyway; the executor is reset on the next start
                log.warning("could not tell the executor to drop aborted requests: %s", describe_failure(e))
        self._publish()

    def _emit(self, handle: RequestHandle, output: RequestOutput) -> None:
        handle.answered = output.is_last
        self._dequeue(handle)
        self._outbox.append((handle, output))

    def _dequeue(self, handle: RequestHandle) -> None:
        """The request produces output or is done: it stops counting against the queue limits."""
        if not handle.dequeued:
            handle.dequeued = True
            self._dequeued_requests += 1
            self._dequeued_tokens += len(handle.prepared.prompt_token_ids)

    def _deliver(self) -> None:
        """Hand the outputs gathered so far over in one call."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self.deliver(outbox)

    def _publish(self) -> None:
        """End of an iteration: deliver the outputs, refresh the stats, release queue room, postpone the probe."""
        self._deliver()
        self._probe_at = time.monotonic() + IDLE_PROBE_S
        self.stats = self._snapshot()
        with self._wakeup:
            self._queued_requests -= self._dequeued_requests
            self._queued_tokens -= self._dequeued_tokens
        self._dequeued_requests = self._dequeued_tokens = 0

    def _snapshot(self) -> LoopStats:
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        return LoopStats(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            num_steps=engine.num_steps,
            num_finished_stop=self._finished[FinishReason.STOP],
            num_finished_length=self._finished[FinishReason.LENGTH],
            num_aborted=self._finished[FinishReason.ABORT],
            num_prefix_cache_hit_tokens=scheduler.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
        )
