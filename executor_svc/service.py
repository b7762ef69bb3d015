"""gRPC shell around any executor object: translates messages and statuses, nothing else."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc.requests import PlanError
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.executor import Executor
from scheduler_svc.security import TLSConfig, bind, transport_name

log = logging.getLogger("nanoserve.executor")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Runs one call at a time: an executor serves exactly one scheduler."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.lock = threading.Lock()

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.ExecutorInfo:
        return self.executor.get_info()

    def Step(self, plan: pb.StepPlan, context: grpc.ServicerContext) -> pb.StepResult:
        with self.lock:
            try:
                return self.executor.step(plan)
            except PlanError as e:
                context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def StepStream(self, plans: Iterator[pb.StepPlan], context: grpc.ServicerContext) -> Iterator[pb.StepResult]:
        for plan in plans:
            yield self.Step(plan, context)

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        with self.lock:
            return pb.ResetResponse(num_dropped_requests=self.executor.reset())


def build_server(
    executor: Executor, host: str, port: int, tls: TLSConfig | None = None,
    health_servicer: health.HealthServicer | None = None,
) -> tuple[grpc.Server, int]:
    """A ready (not started) server with health and reflection; returns it and the bound port.

    With ``tls`` it serves TLS, and mutual TLS when ``tls`` names a CA: the executor
    hop then accepts only a scheduler holding a certificate from that CA. Pass
    ``health_servicer`` to turn it NOT_SERVING later.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(executor), server)
    health_servicer = health_servicer or health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, bind(server, host, port, tls)


def serve(executor: Executor, host: str, port: int, grace_s: float = 5.0, tls: TLSConfig | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then report NOT_SERVING and stop within ``grace_s`` seconds."""
    health_servicer = health.HealthServicer()
    server, bound = build_server(executor, host, port, tls, health_servicer)
    server.start()
    info = executor.get_info()
    log.info(
        "executor serving on %s:%d (%s) model=%s device=%s dtype=%s blocks=%dx%d backend=%s instance=%s",
        host, bound, transport_name(tls), info.model_id, info.device, info.dtype, info.num_blocks, info.block_size,
        info.attention_backend, info.instance_id,
    )
    stopped = threading.Event()

    def stop(signum: int, frame: object) -> None:
        log.info("executor stopping on signal %d", signum)
        health_servicer.enter_graceful_shutdown()
        server.stop(grace_s).wait()
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stopped.wait()
