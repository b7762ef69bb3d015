"""The requests the engine loop has admitted, and the outputs waiting to be delivered to their callers."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.admission import Admission
from scheduler_svc.engine import Engine
from scheduler_svc.errors import RequestFailed
from scheduler_svc.outputs import OutputProcessor, RequestOutput, Usage
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.wire import PreparedRequest


@dataclass(eq=False)
class RequestHandle:
    """A submitted request; ``sink`` is whatever the caller's ``deliver`` needs to reach it."""

    prepared: PreparedRequest
    sink: object
    # Set by the loop thread once the last output (finish or error) is on its way.
    answered: bool = False
    # Set by the loop thread once the request no longer counts against the queue limits.
    dequeued: bool = False


@dataclass
class Active:
    """Loop-thread state of one admitted request."""

    handle: RequestHandle
    seq: Sequence
    processor: OutputProcessor


class InFlight:
    """Loop-thread only: admitted requests by handle and by sequence id, the outbox, finish counts."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.by_handle: dict[RequestHandle, Active] = {}
        self.by_seq_id: dict[int, Active] = {}
        self.outbox: list[tuple[RequestHandle, RequestOutput]] = []
        self.finished: dict[FinishReason, int] = dict.fromkeys(FinishReason, 0)

    def __len__(self) -> int:
        return len(self.by_handle)

    def add(self, active: Active) -> None:
        self.by_handle[active.handle] = self.by_seq_id[active.seq.seq_id] = active

    def emit(self, handle: RequestHandle, output: RequestOutput) -> None:
        """Queue ``output`` for delivery; the request stops counting against the queue limits."""
        handle.answered = output.is_last
        self.dequeue(handle)
        self.outbox.append((handle, output))

    def dequeue(self, handle: RequestHandle) -> None:
        if not handle.dequeued:
            handle.dequeued = True
            self.admission.release(len(handle.prepared.prompt_token_ids))

    def forget(self, active: Active, reason: FinishReason) -> None:
        """The request is done (its last output emitted, or it was cancelled)."""
        del self.by_handle[active.handle]
        del self.by_seq_id[active.seq.seq_id]
        self.finished[reason] += 1
        self.dequeue(active.handle)

    def cancel(self, engine: Engine, handle: RequestHandle) -> None:
        """The caller went away: free the request's blocks now; a request already done is left alone."""
        active = self.by_handle.get(handle)
        if active is not None:
            engine.abort(active.seq)
            self.forget(active, FinishReason.ABORT)

    def fail(self, seqs: list[Sequence], error: RequestFailed) -> None:
        """Answer the requests of ``seqs`` (already finished by the engine) with ``error``."""
        for seq in seqs:
            active = self.by_seq_id[seq.seq_id]
            self.emit(active.handle, RequestOutput(error=error))
            self.forget(active, FinishReason.ABORT)

    def end_all(self, engine: Engine, error: RequestFailed | None = None) -> int:
        """Abort every request and free its blocks: answered with ``error``, or with ABORT and its usage."""
        num = len(self.by_handle)
        for active in list(self.by_handle.values()):
            engine.abort(active.seq)
            output = RequestOutput(error=error) if error else RequestOutput(finish_reason=FinishReason.ABORT,
                                                                             usage=Usage.of(active.seq))
            self.emit(active.handle, output)
            self.forget(active, FinishReason.ABORT)
        return num

    def take_outbox(self) -> list[tuple[RequestHandle, RequestOutput]]:
        outbox, self.outbox = self.outbox, []
        return outbox
