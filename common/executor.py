"""What the scheduler needs from an executor, local object or gRPC client alike."""

from __future__ import annotations

from typing import Protocol

from nanoserve.v1 import executor_pb2 as pb


class Executor(Protocol):
    """The executor contract of ``protos/nanoserve/v1/executor.proto`` as a Python protocol."""

    def get_info(self) -> pb.ExecutorInfo:
        """The handshake: model, KV geometry, tokenizer and the instance id."""
        ...

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        """Run one plan; a rejected plan raises and changes nothing."""
        ...

    def reset(self) -> int:
        """Drop every request's state; return how many were dropped."""
        ...

