"""gRPC shell around any executor object: translates messages and statuses, nothing else."""

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
from common.executor import Executor
from common.security import TLSConfig, bind, transport_name
from executor_svc.requests import PlanError
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger("nanoserve.executor")

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def call_here(fn: Callable[..., T], *args: object) -> T:
    return fn(*args)


class CallingThread:
    """Runs calls made from any thread on the one thread inside ``run``.

    torch work in the executor process stays on one thread: libgomp gives every thread that starts
    parallel work its own team of OpenMP threads, and once a process has more of them than CPUs it cuts
    their spin before sleeping (``executor_svc/openmp.py``) to 100. Steps run on changing gRPC worker
    threads measured 25 % slower on two cores.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[futures.Future, Callable[..., object], tuple] | None] = (
            queue.SimpleQueue()
        )

    def call(self, fn: Callable[..., T], *args: object) -> T:
        future: futures.Future[T] = futures.Future()
        self._calls.put((future, fn, args))
        return future.result()

    def run(self) -> None:
        """Serve calls on this thread until ``stop``."""
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, whatever it is
                future.set_exception(e)

    def stop(self) -> None:
        self._calls.put(None)


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Runs one call at a time: an executor serves exactly one scheduler.

    ``call`` runs the executor's methods: here, on the gRPC worker thread, or through a ``CallingThread``.
    """

    def __init__(self, executor: Executor, call: Callable[..., object] = call_here) -> None:
        self.executor = executor
        self.call = call
        self.lock = threading.Lock()

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.ExecutorInfo:
        return self.executor.get_info()

    def Step(self, plan: pb.StepPlan, context: grpc.ServicerContext) -> pb.StepResult:
        with self.lock:
            try:
                return self.call(self.executor.step, plan)
            except PlanError as e:
                context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def StepStream(self, plans: Iterator[pb.StepPlan], context: grpc.ServicerContext) -> Iterator[pb.StepResult]:
        for plan in plans:
            yield self.Step(plan, context)

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        with self.lock:
            return pb.ResetResponse(num_dropped_requests=self.call(self.executor.reset))


def build_server(
    executor: Executor, host: str, port: int, tls: TLSConfig | None = None,
    health_servicer: health.HealthServicer | None = None, call: Callable[..., object] = call_here,
) -> tuple[grpc.Server, int]:
    """A ready (not started) server with health and reflection; returns it and the bound port.

    With ``tls`` it serves TLS, and mutual TLS when ``tls`` names a CA: the executor
    hop then accepts only a scheduler holding a certificate from that CA. Pass
    ``health_servicer`` to turn it NOT_SERVING later, ``call`` to run the executor's
    steps elsewhere than on gRPC's threads (``CallingThread.call``).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=EXECUTOR_SERVER_OPTIONS)
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(executor, call), server)
    health_servicer = health_servicer or health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, bind(server, host, port, tls)


def serve(executor: Executor, host: str, port: int, grace_s: float = 5.0, tls: TLSConfig | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then report NOT_SERVING and stop within ``grace_s`` seconds.

    The executor's steps run on the calling thread (a ``CallingThread``), which should be the one that
    built the executor.
    """
    health_servicer = health.HealthServicer()
    calling_thread = CallingThread()
    server, bound = build_server(executor, host, port, tls, health_servicer, calling_thread.call)
    server.start()
    info = executor.get_info()
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
