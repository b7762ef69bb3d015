"""``nanoserve replay`` (docs/replay.md): a recording's plans sent to an executor service over gRPC and its results
compared with the recorded ones; ``--shadow`` and ``--model`` are handed to ``python -m executor_svc.runtime.replay``,
which builds that executor in a process of its own (the client imports no executor code)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import grpc

from common.channels import EXECUTOR_CHANNEL_OPTIONS
from common.executor import Executor
from common.recording import RecordingError
from common.replay import ExecutorGone
from common.replay_cli import EXIT_UNAVAILABLE, open_recording, refuse, replay
from common.security import TLSConfig, channel_credentials, secure_or_insecure_channel
from common.step import ExecutorInfo, StepPlan, StepResult
from common.step_codec import info_from_proto, plan_to_proto, result_from_proto
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import executor_pb2_grpc as pb_grpc

IN_PROCESS_MODULE = "executor_svc.runtime.replay"


class ExecutorRefused(RuntimeError):
    """The executor answered a call with an error status: its code and details."""


class GrpcExecutor(Executor):
    """The executor contract over one channel, one unary call at a time: a replay sends a plan once the last one
    is answered."""

    def __init__(self, target: str, tls: TLSConfig | None, timeout_s: float) -> None:
        credentials = channel_credentials(tls) if tls else None
        self.channel = secure_or_insecure_channel(target, credentials, EXECUTOR_CHANNEL_OPTIONS)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.timeout_s = timeout_s

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            kind = ExecutorGone if e.code() == grpc.StatusCode.UNAVAILABLE else ExecutorRefused
            raise kind(f"{e.code().name}: {e.details()}") from None

    def get_info(self) -> ExecutorInfo:
        return info_from_proto(self._call(self.stub.GetInfo, pb.GetInfoRequest()))

    def step(self, plan: StepPlan) -> StepResult:
        return result_from_proto(self._call(self.stub.Step, plan_to_proto(plan)))

    def reset(self) -> int:
        return self._call(self.stub.Reset, pb.ResetRequest()).num_dropped_requests

    def close(self) -> None:
        self.channel.close()


def run_replay(args: argparse.Namespace, tls: TLSConfig | None, argv: list[str]) -> int:
    """``argv``: the replay's own arguments, handed on as they are for --shadow and --model."""
    if not args.executor:
        return subprocess.run([sys.executable, "-m", IN_PROCESS_MODULE, *argv]).returncode
    try:
        recording = open_recording(args)
    except RecordingError as e:
        return refuse(e)
    executor = GrpcExecutor(args.executor, tls, args.timeout)
    try:
        return replay(executor, recording, args)
    except (ExecutorRefused, ExecutorGone) as e:  # unreachable, or refused a handshake or a reset
        print(f"error: executor {args.executor}: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    finally:
        executor.close()
