"""What the engine checks of its executor: the same instance, the same model, the plan awaited, and what the
scheduler's flags need of it."""

from __future__ import annotations

from copy import copy

from common.step import ExecutorInfo
from scheduler_svc.core.scheduler_config import SchedulerConfig

# On a CPU a step costs about as much per row from a few rows on as one decode row does alone (it is bound by
# compute, not by reading the weights), so a proposal pays only in small batches: without
# --speculative-disable-by-batch-size, an executor on a CPU gets no proposals while more sequences than this run
# (docs/scheduler.md says where it was measured).
CPU_SPECULATION_BATCH_LIMIT = 4


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


def serving_overlap(overlap: bool | None, on_cpu: bool) -> bool:
    """``--overlap``, or where it is unset: on beside an accelerator, off where the executor computes on the CPU, whose
    step the scheduler's work cannot hide behind and where a step queued ahead holds an arrival's prefill back."""
    return not on_cpu if overlap is None else overlap


def serving_plans_ahead(plans_ahead: int | None, on_cpu: bool) -> int:
    """``--plans-ahead``, or where it is unset: 2 beside an accelerator, where a plan that reaches the executor late
    (its result and the next plan each wait for a core on a busy host) would otherwise leave the device idle (W5
    ``api``), and 1 on the CPU, where each step queued ahead holds an arrival's prefill back by a whole forward."""
    if plans_ahead is not None and plans_ahead < 1:
        raise ValueError(f"plans_ahead must be at least 1, not {plans_ahead}")
    return (1 if on_cpu else 2) if plans_ahead is None else plans_ahead


def serving_config(config: SchedulerConfig, info: ExecutorInfo) -> SchedulerConfig:
    """``config`` checked against this executor (``check_draft_model``; ValueError) and completed where the flags left
    it open: speculation only in small batches on a CPU (``CPU_SPECULATION_BATCH_LIMIT``)."""
    check_draft_model(config, info)
    if config.speculative and config.speculative_disable_by_batch_size is None and info.on_cpu:
        config = copy(config)  # checked whole once: ``replace`` would check the window it completed again
        config.speculative_disable_by_batch_size = CPU_SPECULATION_BATCH_LIMIT
    return config
