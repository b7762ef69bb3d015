"""The executor contract over gRPC: what the scheduler service talks to."""

from __future__ import annotations

import grpc

from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.security import secure_or_insecure_channel

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class RemoteExecutor:
    """An ``Executor`` whose calls go over one reused channel to an executor service.

    ``credentials`` (``security.channel_credentials``) make the channel TLS, with a
    client certificate for an executor that requires mutual TLS; plaintext without.
    ``step_timeout_s`` bounds every call, so a hung executor fails like a dead one.
    """

    def __init__(self, target: str, step_timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target
        self.step_timeout_s = step_timeout_s
        self.channel = secure_or_insecure_channel(target, credentials, CHANNEL_OPTIONS)
        self.stub = pb_grpc.ExecutorStub(self.channel)

    def get_info(self, timeout_s: float | None = None, wait_for_ready: bool = False) -> pb.ExecutorInfo:
        timeout = self.step_timeout_s if timeout_s is None else timeout_s
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        return self.stub.Step(plan, timeout=self.step_timeout_s)

    def reset(self) -> int:
        return self.stub.Reset(pb.ResetRequest(), timeout=self.step_timeout_s).num_dropped_requests

    def close(self) -> None:
        self.channel.close()
