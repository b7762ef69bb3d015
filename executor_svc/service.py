"""gRPC shell around any executor object: translates messages (``common.step_codec``) and statuses, nothing else."""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.channels import EXECUTOR_SERVER_OPTIONS
from common.cpu_yield import thread_ids, yield_cpu
from common.executor import Executor, LoraRefused
from common.heap import freeze_startup_heap
from common.security import TLSConfig, bind, transport_name
from common.step import LoraAdapterInfo, StepResult
from common.step_codec import info_to_proto, lora_to_proto, plan_from_proto, result_to_proto
from executor_svc.core.request_table import PlanError
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger("nanoserve.executor")

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def run_into(future: futures.Future[T], fn: Callable[..., T], args: tuple) -> futures.Future[T]:
    """Run ``fn(*args)`` here and settle ``future`` with its result or exception."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to the caller, whatever it is
        future.set_exception(e)
    return future


def submit_here(fn: Callable[..., T], *args: object) -> futures.Future[T]:
    """Run ``fn`` now, on the submitting thread; a finished future."""
    return run_into(futures.Future(), fn, args)


Submit = Callable[..., futures.Future]


# A signal's Python handler runs on the main thread once it runs Python again. The kernel may deliver SIGTERM to
# another thread (a gRPC one), and a main thread parked in ``SimpleQueue.get`` for a call that never comes (an
# executor the scheduler refused) never ran it: the process ignored SIGTERM until killed. Waking bounds the delay.
IDLE_WAKE_S = 0.5


class CallingThread:
    """Runs calls made from any thread on the one thread inside ``run``, in the order submitted.

    torch work in the executor process stays on one thread: libgomp gives every thread that starts
    parallel work its own team of OpenMP threads, and once a process has more of them than CPUs it cuts
    their spin before sleeping (``executor_svc/cpu/openmp.py``) to 100. Steps run on changing gRPC worker
    threads measured slower.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[futures.Future, Callable[..., object], tuple] | None] = (
            queue.SimpleQueue()
        )

    def submit(self, fn: Callable[..., T], *args: object) -> futures.Future[T]:
        future: futures.Future[T] = futures.Future()
        self._calls.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: object) -> T:
        return self.submit(fn, *args).result()

    def run(self) -> None:
        """Serve calls on this thread until ``stop``, waking every ``IDLE_WAKE_S`` while there are none."""
        while True:
            try:
                item = self._calls.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                continue
            if item is None:
                return
            run_into(*item)

    def stop(self) -> None:
        self._calls.put(None)


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Runs one call at a time: an executor serves exactly one scheduler.

    ``submit`` runs the executor's methods: here, on the gRPC worker thread (``submit_here``), or on a
    ``CallingThread``. The lock is taken by the thread that runs the method, so a call queued on the
    calling thread never waits for one that waits for it.
    """

    def __init__(self, executor: Executor, submit: Submit = submit_here) -> None:
        self.executor = executor
        self.submit = submit
        # A StepStream prepares the next plan under prepare_lock while the step before executes under lock;
        # every other call takes both (prepare_lock first).
        self.prepare_lock = threading.Lock()
        self.lock = threading.Lock()
        self.halves = executor.prepares_ahead

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self.prepare_lock, self.lock:
            return fn(*args)

    def _executing(self, fn: Callable[..., T], *args: object) -> T:
        with self.lock:
            return fn(*args)

    def _run(self, fn: Callable[..., T], *args: object) -> futures.Future[T]:
        return self.submit(self._locked, fn, *args)

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.ExecutorInfo:
        return info_to_proto(self.executor.get_info())

    def Step(self, plan: pb.StepPlan, context: grpc.ServicerContext) -> pb.StepResult:
        return self._answer(self._run(self.executor.step, plan_from_proto(plan)), context)

    def StepStream(self, plans: Iterator[pb.StepPlan], context: grpc.ServicerContext) -> Iterator[pb.StepResult]:
        """Steps run back to back, each as soon as the one before is computed and its plan has arrived.

        A reader thread takes plans off the stream as they come. An executor whose step comes in halves and
        that ``prepares_ahead`` (``executor_svc.core.step_pipeline.TableExecutor`` off the CPU) has each plan
        applied and its input packed there, while the step before still runs, and only the execution queued; any other
        executor has the whole step queued. This generator yields the results in order, so gRPC serialises
        and sends step N's while step N+1 runs (vLLM's async scheduling does the same). After a step fails
        no later plan of the stream runs: the scheduler sent them before it knew, so they change nothing it
        relies on (it resets the executor to recover), and the stream ends with the failed step's status (or
        the stream's own error, as when the scheduler cancels it).
        """
        started: queue.SimpleQueue[futures.Future[StepResult | None] | None] = queue.SimpleQueue()
        failed = threading.Event()

        def guarded(fn: Callable[[T], StepResult], arg: T) -> StepResult | None:
            if failed.is_set():
                return None
            try:
                return fn(arg)
            except BaseException:
                failed.set()
                raise

        refused = threading.Event()  # a plan failed to prepare: none after it is prepared

        def submit(plan: pb.StepPlan) -> futures.Future[StepResult | None]:
            plan = plan_from_proto(plan)
            if not self.halves:
                return self._run(guarded, self.executor.step, plan)
            if failed.is_set() or refused.is_set():
                return submit_here(lambda: None)
            try:
                with self.prepare_lock:
                    prepared = self.executor.prepare(plan)
            except BaseException as e:  # raised in its turn, after the steps queued before it have run
                refused.set()
                return self.submit(self._executing, guarded, raise_, e)
            return self.submit(self._executing, guarded, self.executor.execute, prepared)

        def read() -> None:
            try:
                for plan in plans:
                    started.put(submit(plan))
            except Exception as e:  # the stream's end (cancelled, broken): raised below, where gRPC sees it
                started.put(submit_here(raise_, e))
            started.put(None)

        threading.Thread(target=read, name="step-stream-reader", daemon=True).start()
        while (future := started.get()) is not None:
            yield self._answer(future, context)

    @staticmethod
    def _answer(future: futures.Future[StepResult | None], context: grpc.ServicerContext) -> pb.StepResult | None:
        """The step's result, or the call ended with a refused plan's status (None: a step after a failed one)."""
        try:
            result = future.result()
            return None if result is None else result_to_proto(result)
        except PlanError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def CutStep(self, request: pb.CutStepRequest, context: grpc.ServicerContext) -> pb.CutStepResponse:
        """Not queued behind the step it cuts: it only marks it (an executor without multi-step cuts ignores it)."""
        self.executor.cut(request.step_id)
        return pb.CutStepResponse()

    def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context: grpc.ServicerContext) -> pb.LoraAdapter:
        """Between steps (both locks), so that no plan runs while the adapters change."""
        return self._lora(self.executor.load_lora, context, request.name, request.path)

    def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context: grpc.ServicerContext
                          ) -> pb.LoraAdapter:
        return self._lora(self.executor.unload_lora, context, request.name)

    def _lora(self, fn: Callable[..., LoraAdapterInfo], context: grpc.ServicerContext, *args: str) -> pb.LoraAdapter:
        try:
            return lora_to_proto(self._run(fn, *args).result())
        except LoraRefused as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        return pb.ResetResponse(num_dropped_requests=self._run(self.executor.reset).result())


def raise_(error: Exception) -> None:
    raise error


def build_server(
    executor: Executor, host: str, port: int, tls: TLSConfig | None = None,
    health_servicer: health.HealthServicer | None = None, submit: Submit = submit_here,
) -> tuple[grpc.Server, int]:
    """A ready (not started) server with health and reflection; returns it and the bound port.

    With ``tls`` it serves TLS, and mutual TLS when ``tls`` names a CA: the executor
    hop then accepts only a scheduler holding a certificate from that CA. Pass
    ``health_servicer`` to turn it NOT_SERVING later, ``submit`` to run the executor's
    steps elsewhere than on gRPC's threads (``CallingThread.submit``).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=EXECUTOR_SERVER_OPTIONS)
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(executor, submit), server)
    health_servicer = health_servicer or health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, bind(server, host, port, tls)


def serve(executor: Executor, host: str, port: int, grace_s: float = 5.0, tls: TLSConfig | None = None,
          yield_helpers: bool = False) -> None:
    """Serve until SIGTERM or SIGINT, then report NOT_SERVING and stop within ``grace_s`` seconds; a port in use
    logs one line and exits with status 1.

    The executor's steps run on the calling thread (a ``CallingThread``), which should be the one that
    built the executor. With ``yield_helpers``, on the CPU every thread but this one and its OpenMP team (gRPC's,
    the streams', now and later) runs in SCHED_IDLE, so that none preempts the forward pass (``common.cpu_yield``).
    """
    freeze_startup_heap()
    forward_threads = thread_ids()  # this one and the OpenMP team it started while the model loaded
    health_servicer = health.HealthServicer()
    calling_thread = CallingThread()
    try:
        server, bound = build_server(executor, host, port, tls, health_servicer, calling_thread.submit)
    except OSError as e:  # the port in use: one clear line, as the scheduler says it, not a traceback
        log.error("cannot serve: %s", e)
        raise SystemExit(1) from None
    server.start()
    info = executor.get_info()
    if yield_helpers and info.on_cpu:
        # Threads gRPC starts later come from these, and are idle too.
        log.debug("%d helper threads yield the CPU to the forward pass", yield_cpu(thread_ids() - forward_threads))
    log.info(
        "executor serving on %s:%d (%s) model=%s device=%s dtype=%s blocks=%dx%d backend=%s instance=%s",
        host, bound, transport_name(tls), info.model_id, info.device, info.dtype, info.num_blocks, info.block_size,
        info.attention_backend, info.instance_id,
    )

    def shut_down() -> None:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace_s).wait()
        calling_thread.stop()

    def stop(signum: int, frame: object) -> None:
        # Stopping waits for steps in flight, and they need this thread: stop from another one.
        log.info("executor stopping on signal %d", signum)
        threading.Thread(target=shut_down, name="shutdown").start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    calling_thread.run()
