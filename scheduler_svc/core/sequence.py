"""A request as the scheduler sees it: tokens, KV progress and its block table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum, auto
from typing import TYPE_CHECKING

from scheduler_svc.core.sampling import SamplingParams

if TYPE_CHECKING:
    from common.step import PromptLogprobs
    from scheduler_svc.core.speculation import SequenceSpeculation
    from scheduler_svc.core.stop_rules import StopRule

# Stands in a sequence's token list for a token its in-flight step has not returned yet.
PENDING = -1


def max_kv_blocks(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int) -> int:
    """KV blocks a sequence holds at its longest; the last sampled token is never fed back, so needs no slot."""
    max_kv_len = min(num_prompt_tokens + max_tokens, max_model_len) - 1
    return (max(num_prompt_tokens, max_kv_len) + block_size - 1) // block_size


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # vLLM's repetition_detection: the completion's last tokens repeat a pattern.
    REPETITION = "repetition"


class Sequence:
    """Prompt plus completion tokens and how far their KV cache is computed.

    ``num_cached_tokens`` counts tokens whose KV is in the cache (prefix hits
    included); ``num_scheduled_tokens`` is this step's share, set by
    ``Scheduler.schedule`` and moved into ``num_cached_tokens`` by
    ``Scheduler.advance`` when the step is booked as computed (``finish`` and
    ``requeue_all`` zero it too).
    """

    def __init__(self, seq_id: int, token_ids: list[int], params: SamplingParams, block_size: int,
                 num_prompt_tokens: int | None = None, lora_id: int = 0, cache_salt: str = "") -> None:
        """``num_prompt_tokens`` below ``len(token_ids)``: the rest is completion a client resumes with, counted as
        generated like a preempted sequence's. ``lora_id``: the executor's id of the LoRA adapter it runs through
        (0: the base model); it keys its blocks in the prefix cache and stays through preemption, as does
        ``cache_salt`` (its request's; "": none), which keeps its blocks from every other salt's."""
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.lora_id, self.cache_salt = lora_id, cache_salt
        # Its request's priority: lower runs first under ``--request-order priority`` (``core.request_order``), and
        # its request's arrival, which breaks ties: its own id, or that of its request's first choice.
        self.priority, self.arrival = 0, seq_id
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.block_size = block_size
        self.params = params
        self.finish_reason: FinishReason | None = None
        # Prompt tokens served from the prefix cache at the first allocation.
        self.num_prefix_hit_tokens: int | None = None
        # When the engine first scheduled it (time.monotonic), for the queue-time metric; the scheduler keeps no clock.
        self.scheduled_at: float | None = None
        # True once the token in flight is its last (max_tokens or the model's length): it is not
        # scheduled again while it waits for that token.
        self.final_token_pending = False
        # With params.prompt_logprobs: the logprobs of prompt tokens 1.. as the executor computed them.
        self.prompt_logprobs: list = []
        # The most decode steps one plan computes for it (with multi-step scheduling): the tokens its reader takes at
        # a time, so that a plan never holds back a token the reader would have had sooner (1: a token-by-token
        # stream; inf: a reader of whole completions).
        self.max_decode_steps: float = math.inf
        # When its completion ends on its tokens (``stop_rules``): set by the scheduler that queues it.
        self.stop_rule: StopRule | None = None
        # Speculative decoding (``core.speculation``): whether its request may speculate at all (False for the
        # choices of n > 1), its proposer state once queued where it may, the proposals the scheduler chose for the
        # coming step (their ids: empty for the executor's draft model), and whether a verification is in flight
        # (it is held until its result: the next plan starts where verification ended).
        self.speculate = True
        self.speculation: SequenceSpeculation | None = None
        self.num_draft_tokens = 0
        self.draft_token_ids: list[int] = []
        self.verifying = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]


def keep_prompt_logprobs(seqs: Iterable[Sequence], runs: Iterable[PromptLogprobs]) -> None:
    """Append each run of prompt logprobs to its sequence from where the sequence's own end: a recomputed prompt
    (after a preemption or a restart) sends runs it has already, which are dropped."""
    by_id = {run.request_id: run for run in runs}
    for seq in seqs:
        if (run := by_id.get(seq.seq_id)) is not None:
            seq.prompt_logprobs += run.logprobs[max(0, len(seq.prompt_logprobs) + 1 - run.first_position):]
