"""What the scheduler's engine needs from an executor, local object or gRPC client alike: every method it calls.

Executors subclass this Protocol, so an executor without a capability inherits its plain form: no multi-step plan
to cut, a step that is not split in halves, no step stream of its own.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from common.step import ExecutorInfo, LoraAdapterInfo, StepPlan, StepResult


class LoraRefused(ValueError):
    """A load or unload of a LoRA adapter refused, changing nothing; ``code`` is the gRPC status name it travels
    as (INVALID_ARGUMENT: the adapter does not fit; FAILED_PRECONDITION: not now, or not on this executor;
    NOT_FOUND: no adapter by that name)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


class Executor(Protocol):
    """The executor contract of ``protos/nanoserve/v1/executor.proto`` on ``common.step``'s plain types."""

    # ``prepare`` can run on another thread beside the ``execute`` of the step before (off the CPU: a forward on
    # the CPU keeps every core busy, and work beside it stalls it).
    prepares_ahead: bool = False
    # ``submit`` sends plans down an ordered stream of the executor's own (the gRPC client's StepStream); without
    # one the engine runs the steps on a worker thread of its own.
    streams: bool = False

    def get_info(self) -> ExecutorInfo:
        """The handshake: model, KV geometry, tokenizer and the instance id."""
        ...

    def step(self, plan: StepPlan) -> StepResult:
        """Run one plan; a rejected plan raises and changes nothing."""
        ...

    def reset(self) -> int:
        """Drop every request's state; return how many were dropped."""
        ...

    def cut(self, step_id: int) -> None:
        """CutStep: stop multi-step plan ``step_id`` after the pass in progress. Advisory: an executor that runs no
        multi-step plans has nothing to cut."""

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a PEFT LoRA adapter while serving; LoraRefused where this executor cannot."""
        raise LoraRefused("this executor serves no LoRA adapters", "FAILED_PRECONDITION")

    def unload_lora(self, name: str) -> LoraAdapterInfo:
        """Unload an adapter no request uses; LoraRefused otherwise."""
        raise LoraRefused("this executor serves no LoRA adapters", "FAILED_PRECONDITION")

    def prepare(self, plan: StepPlan) -> object:
        """The first half of ``step``: apply the plan and pack its input; the second half is ``execute``."""
        return plan

    def execute(self, prepared: object) -> StepResult:
        """The second half of ``step``, after the step before it: run what ``prepare`` made."""
        return self.step(prepared)

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """Send ``plan`` without waiting (where ``streams``); results resolve in the order sent. The plain form runs
        the step here."""
        future: Future[StepResult] = Future()
        try:
            future.set_result(self.step(plan))
        except Exception as e:
            future.set_exception(e)
        return future
