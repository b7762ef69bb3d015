"""What the engine loop publishes after each iteration, for GetStats (and metrics) to read from any thread."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.sequence import FinishReason

if TYPE_CHECKING:  # the engine imports the wire translation, which reads these stats
    from scheduler_svc.engine import Engine


@dataclass(frozen=True)
class LoopStats:
    num_waiting: int = 0
    num_running: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_steps: int = 0
    num_finished_stop: int = 0
    num_finished_length: int = 0
    num_aborted: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def of(cls, engine: Engine, finished: Mapping[FinishReason, int]) -> LoopStats:
        scheduler, blocks = engine.scheduler, engine.block_manager
        return cls(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            num_steps=engine.num_steps,
            num_finished_stop=finished[FinishReason.STOP],
            num_finished_length=finished[FinishReason.LENGTH],
            num_aborted=finished[FinishReason.ABORT],
            num_prefix_cache_hit_tokens=scheduler.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
        )
