"""What the engine loop tells the outside: the stats it publishes after each iteration, for GetStats and the
metrics to read from any thread, and what it reports as it goes to a ``LoopObserver`` (``metrics.Metrics``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, islice
from typing import TYPE_CHECKING, Protocol

from scheduler_svc.core.sequence import FinishReason, Sequence

if TYPE_CHECKING:  # live_requests imports LoopObserver from here: importing it back would be a circle
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.engine.live_requests import LiveRequests


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
    num_finished_repetition: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding (``core.speculation``): verifications, tokens proposed and accepted, and their ratio.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    # The rest are not in GetStats' message, only in the metrics.
    # Whether speculation is on, and the accepted tokens by their position in the proposal (0 first).
    speculative: bool = False
    spec_accepted_per_position: tuple[int, ...] = ()
    num_prefix_cache_query_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_executor_restarts: int = 0
    executor_up: bool = True
    # Choices an engine-side failure ended (vLLM's finish reason "error"); ``num_aborted`` counts client aborts.
    num_failed: int = 0
    # Where the executor can serve LoRA adapters: --max-loras (else 0), and the adapters of the running and the
    # waiting requests, each as sorted names joined by commas (the ``lora_requests_info`` gauge's labels).
    max_loras: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""

    @classmethod
    def of(cls, engine: Engine, requests: LiveRequests, executor_up: bool, num_held: int = 0) -> LoopStats:
        """``num_held``: requests a pause holds back before the engine (``engine.pause``), waiting too."""
        scheduler, blocks, finished = engine.scheduler, engine.block_manager, requests.finished
        prefilling = num_prefilling(scheduler.waiting)
        return cls(
            num_waiting=len(scheduler.waiting) - prefilling + num_held,
            num_running=len(scheduler.running) + prefilling,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            num_steps=engine.num_steps,
            num_finished_stop=finished[FinishReason.STOP],
            num_finished_length=finished[FinishReason.LENGTH],
            num_aborted=finished[FinishReason.ABORT],
            num_finished_repetition=finished[FinishReason.REPETITION],
            num_prefix_cache_hit_tokens=scheduler.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_cache_query_tokens=scheduler.num_prefix_query_tokens,
            num_prompt_tokens=requests.num_prompt_tokens,
            num_generation_tokens=requests.num_generation_tokens,
            num_executor_restarts=engine.num_restarts,
            executor_up=executor_up,
            num_failed=requests.num_failed,
            **lora_labels(engine, prefilling),
            **spec_counts(engine),
        )


def num_prefilling(waiting: deque[Sequence]) -> int:
    """1 while the head of ``waiting`` is part-way through a chunked prefill (it holds blocks: only it can, as a
    preempted sequence gives its blocks back and waits behind it, ``Scheduler``), else 0. vLLM counts a request
    running from its first scheduled chunk; so do the gauges and GetStats."""
    return int(bool(waiting) and bool(waiting[0].block_table))


def spec_counts(engine: Engine) -> dict[str, object]:
    """The ``LoopStats`` speculative-decoding fields, where speculation is on."""
    speculator = engine.scheduler.speculator
    if speculator is None:
        return {}
    counters = speculator.counters
    return dict(num_spec_drafts=counters.num_drafts, num_spec_draft_tokens=counters.num_draft_tokens,
                num_spec_accepted_tokens=counters.num_accepted_tokens,
                spec_acceptance_rate=speculator.acceptance_rate, speculative=True,
                spec_accepted_per_position=tuple(counters.accepted_per_position))


def lora_labels(engine: Engine, prefilling: int) -> dict[str, object]:
    """The ``LoopStats`` LoRA fields: a look at every live request, wherever the executor can serve adapters (as
    vLLM emits its gauge whenever LoRA is on, with no adapter loaded yet too: the endpoint picker then sees room).
    ``prefilling``: the head of waiting part-way through its prefill, running as the gauges count it."""
    if not engine.info.max_lora_rank:
        return {}
    scheduler, name_of = engine.scheduler, engine.adapters.name_of
    if not engine.adapters.by_name and not engine.adapters.retiring:  # no request runs through an adapter
        return dict(max_loras=scheduler.max_loras or 0)
    waiting = scheduler.waiting

    def names(seqs: Iterable[Sequence]) -> str:
        return ",".join(sorted({name_of(seq.lora_id) for seq in seqs if seq.lora_id}))

    return dict(max_loras=scheduler.max_loras or 0,
                running_lora_adapters=names(chain(scheduler.running, islice(waiting, prefilling))),
                waiting_lora_adapters=names(islice(waiting, prefilling, None)))


class LoopObserver(Protocol):
    """Told, on the loop thread, the times and sizes that the stats' counters cannot carry; each call must be cheap."""

    def step(self, num_tokens: int, forward_s: float) -> None:
        """An engine step (one plan: a multi-step decode's passes together) computed ``num_tokens`` tokens; the
        executor's forward passes took ``forward_s``."""

    def first_token(self, seconds: float) -> None:
        """A choice's first token came out ``seconds`` after its request arrived."""

    def inter_tokens(self, seconds: float, count: int) -> None:
        """``count`` choices each got tokens ``seconds`` after their previous ones."""

    def finished(self, seconds: float, queued_s: float | None, prompt_tokens: int, generation_tokens: int) -> None:
        """A choice ended ``seconds`` after its request arrived, having waited ``queued_s`` from its submission to its
        first step (None: never scheduled)."""
