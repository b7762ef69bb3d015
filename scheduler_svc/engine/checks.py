"""What the engine checks of its executor: the same instance, the same model, the plan awaited, and what the
scheduler's flags need of it."""

from __future__ import annotations

from common.step import ExecutorInfo
from scheduler_svc.core.scheduler_config import SchedulerConfig


class ExecutorRestarted(RuntimeError):
    """The executor answered with a new instance id: its KV cache is gone."""


class IncompatibleExecutor(RuntimeError):
    """The executor came back serving another model or vocabulary; requests cannot carry over."""


class StepMismatch(RuntimeError):
    """A result answered another plan than the one awaited: the stream lost its order."""


def check_draft_model(config: SchedulerConfig, info: ExecutorInfo) -> None:
    """``--speculative draft`` needs an executor that holds a draft model (its handshake names one)."""
    if config.speculative == "draft" and not info.draft_model_id:
        raise ValueError(f"--speculative draft needs an executor started with a draft model (--speculative-model), "
                         f"but executor {info.model_id!r} reports none; use --speculative ngram, or start it with one")
