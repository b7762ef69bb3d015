"""When a completion ends on its tokens: the one definition of the stop rule.

A completion ends at the first token that is an EOS (unless ``ignore_eos``) or one of its stop token ids, counted
only from ``min_tokens`` on; else once it holds ``max_tokens`` tokens or the sequence reaches the model's length.
The scheduler applies it as a step's tokens settle, validation to a resumed completion. Stop strings end a
completion on its text, in the output processor, from the same ``min_tokens`` on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import FinishReason


@dataclass(frozen=True, slots=True)
class StopRule:
    """One request's stop rule, worked out once: it is checked for every token it samples."""

    # The EOS ids (unless ignore_eos) and the request's stop token ids.
    stop_ids: frozenset[int]
    min_tokens: int
    # Completion tokens at which it ends by length: max_tokens, or fewer where the model's length comes first.
    max_completion: int

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: Collection[int],
           max_model_len: int) -> StopRule:
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | frozenset(eos_token_ids)
        return cls(stop_ids, params.min_tokens, min(params.max_tokens, max_model_len - num_prompt_tokens))

    def check(self, sampled: Sequence[int], num_done: int) -> tuple[int, FinishReason | None]:
        """How many of ``sampled`` (completion tokens from number ``num_done`` on) the completion keeps, and why it
        ends there (None: it goes on)."""
        stop_ids = self.stop_ids
        if stop_ids and not stop_ids.isdisjoint(sampled):
            for k in range(max(0, self.min_tokens - num_done - 1), len(sampled)):
                if sampled[k] in stop_ids:
                    return k + 1, FinishReason.STOP
        return len(sampled), FinishReason.LENGTH if num_done + len(sampled) >= self.max_completion else None

    def ends_by_length(self, num_completion: int) -> bool:
        """Whether a completion of this many tokens has reached its length."""
        return num_completion >= self.max_completion
