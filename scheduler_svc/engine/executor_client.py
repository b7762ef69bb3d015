"""The executor contract over gRPC: what the scheduler service talks to; plans and results cross
``common.step_codec`` here, so the engine sees only plain types."""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

import grpc

from common.channels import EXECUTOR_CHANNEL_OPTIONS
from common.executor import Executor, LoraRefused
from common.security import secure_or_insecure_channel
from common.step import ExecutorInfo, LoraAdapterInfo, StepPlan, StepResult
from common.step_codec import info_from_proto, lora_from_proto, plan_to_proto, result_from_proto
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.engine.turn import Turn

# GetInfo answers from memory, without waiting for a step: a deadline this short still fails only a hung executor,
# and an idle probe then holds the loop (admission, cancellation) for at most this long.
INFO_TIMEOUT_S = 5.0


def describe_failure(error: Exception) -> str:
    """One line for the log: the gRPC status and details, or the exception's type and message."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, TimeoutError):  # the overlapped step's wait: what the unary Step's deadline reports
        return "DEADLINE_EXCEEDED: the step in flight got no result within --step-timeout"
    return f"{type(error).__name__}: {error}"


# The statuses of an executor's refusal to load or unload an adapter (``common.executor.LoraRefused``).
LORA_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.UNIMPLEMENTED)


class RemoteExecutor(Executor):
    """An ``Executor`` whose calls go over one reused channel to an executor service.

    ``credentials`` (``security.channel_credentials``) make the channel TLS, with a
    client certificate for an executor that requires mutual TLS; plaintext without.
    ``step_timeout_s`` bounds every step and reset, ``info_timeout_s`` every GetInfo (the handshake and the
    idle probe), so a hung executor fails like a dead one. ``turn``: taken as each step's result arrives, ended as
    the next plan is sent (``engine.turn``).
    """

    streams = True

    def __init__(self, target: str, step_timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, info_timeout_s: float = INFO_TIMEOUT_S,
                 turn: Turn | None = None, chat_template: str = "") -> None:
        self.target = target
        # The scheduler's --chat-template, which replaces the handshake's ("": the model's own).
        self.chat_template = chat_template
        self.turn = turn or Turn()
        self.step_timeout_s = step_timeout_s
        self.info_timeout_s = info_timeout_s if step_timeout_s is None else min(info_timeout_s, step_timeout_s)
        self.channel = secure_or_insecure_channel(target, credentials, EXECUTOR_CHANNEL_OPTIONS)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self._stream: StepStream | None = None
        self._cuts: set[grpc.Future] = set()

    def get_info(self, timeout_s: float | None = None, wait_for_ready: bool = False) -> ExecutorInfo:
        """The executor's handshake; its chat template replaced by ``chat_template`` where one is given."""
        timeout = self.info_timeout_s if timeout_s is None else timeout_s
        info = info_from_proto(self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready))
        return replace(info, chat_template=self.chat_template) if self.chat_template else info

    def step(self, plan: StepPlan) -> StepResult:
        return result_from_proto(self.stub.Step(plan_to_proto(plan), timeout=self.step_timeout_s))

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """Send ``plan`` down the step stream without waiting; results resolve in the order sent."""
        stream = self._stream
        if stream is None or stream.closed:
            stream = self._stream = StepStream(self.stub, self.turn)
        return stream.submit(plan_to_proto(plan))

    def cut(self, step_id: int) -> None:
        """Ask the executor to stop multi-step plan ``step_id`` early, without waiting: the call is advisory, and a
        failed one (an executor without CutStep, or gone: the step itself fails then) changes nothing."""
        call = self.stub.CutStep.future(pb.CutStepRequest(step_id=step_id), timeout=self.info_timeout_s)
        self._cuts.add(call)  # a call gRPC holds no reference to is cancelled when collected
        call.add_done_callback(self._cuts.discard)

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        return self._lora(self.stub.LoadLoraAdapter, pb.LoadLoraAdapterRequest(name=name, path=path))

    def unload_lora(self, name: str) -> LoraAdapterInfo:
        return self._lora(self.stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(name=name))

    def _lora(self, call: grpc.UnaryUnaryMultiCallable, request: object) -> LoraAdapterInfo:
        """The executor's refusal comes back as LoraRefused with its status; reading an adapter takes a while, so
        the step timeout bounds the call."""
        try:
            return lora_from_proto(call(request, timeout=self.step_timeout_s))
        except grpc.RpcError as e:
            if e.code() in LORA_REFUSALS:
                raise LoraRefused(e.details(), e.code().name) from None
            raise

    def reset(self) -> int:
        """Drop every request's state, and the step stream: no answer of an older step can come back."""
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        return self.stub.Reset(pb.ResetRequest(), timeout=self.step_timeout_s).num_dropped_requests

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        self.channel.close()


# The longest ``submit`` waits for gRPC's sending thread to take the plan (a stream still opening takes longer).
HAND_OVER_S = 0.002


class StepStream:
    """One ``StepStream`` call: plans go out as they are submitted, a reader thread matches each
    result to the oldest unanswered plan. When the stream ends, every unanswered plan fails with
    the stream's error and the stream is ``closed``; the next ``submit`` opens a new one. The engine's ``turn``
    starts as a result arrives and ends as gRPC takes the next plan to send it.

    ``submit`` waits (up to ``hand_over_s``) until gRPC's sending thread has taken the plan: the engine loop goes on
    to process the step before's outputs, and the sending thread, woken meanwhile, otherwise waited for the GIL behind
    all of that, the executor idle, before the plan left (docs/benchmarks-history.md, "The plan's hand-over")."""

    def __init__(self, stub: pb_grpc.ExecutorStub, turn: Turn, hand_over_s: float = HAND_OVER_S) -> None:
        self._turn = turn
        self._hand_over_s = hand_over_s
        self._plans: queue.SimpleQueue[pb.StepPlan | None] = queue.SimpleQueue()
        self._taken = threading.Condition(threading.Lock())
        self._num_put = self._num_taken = 0
        self._waiting: deque[Future[StepResult]] = deque()
        self._lock = threading.Lock()
        self.closed = False
        self._call = stub.StepStream(iter(self._next_plan, None))
        threading.Thread(target=self._read, name="step-stream", daemon=True).start()

    def _next_plan(self) -> pb.StepPlan | None:
        """gRPC's sending thread: the next plan to send, once there is one."""
        plan = self._plans.get()
        self._turn.end()
        with self._taken:
            self._num_taken += 1
            self._taken.notify()
        return plan

    def submit(self, plan: pb.StepPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        with self._lock:
            if self.closed:
                future.set_exception(ConnectionError("the step stream is closed"))
                return future
            self._waiting.append(future)
            self._plans.put(plan)
            self._num_put += 1
            num_put = self._num_put
        with self._taken:
            self._taken.wait_for(lambda: self._num_taken >= num_put, self._hand_over_s)
        return future

    def cancel(self) -> None:
        self._plans.put(None)
        self._call.cancel()

    def _read(self) -> None:
        error: Exception = ConnectionError("the executor closed the step stream")
        try:
            for result in self._call:
                self._turn.take()
                with self._lock:
                    future = self._waiting.popleft()
                future.set_result(result_from_proto(result))
        except grpc.RpcError as e:
            error = e
        with self._lock:
            self.closed = True
            waiting, self._waiting = self._waiting, deque()
        self._plans.put(None)
        for future in waiting:
            future.set_exception(error)
