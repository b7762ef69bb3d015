"""When a completion ends on its tokens: the one definition of the stop rule.

A completion ends at the first token that is an EOS (unless ``ignore_eos``) or one of its stop token ids, or that
completes a pattern repeated as vLLM's ``repetition_detection`` says, counted only from ``min_tokens`` on; else once
it holds ``max_tokens`` tokens or the sequence reaches the model's length.
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
    # vLLM's repetition_detection: (min_pattern_size, max_pattern_size, min_count); None: not asked.
    repetition: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: Collection[int],
           max_model_len: int) -> StopRule:
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | frozenset(eos_token_ids)
        return cls(stop_ids, params.min_tokens, min(params.max_tokens, max_model_len - num_prompt_tokens),
                   params.repetition_detection)

    def check(self, sampled: Sequence[int], num_done: int,
              before: Sequence[int] = ()) -> tuple[int, FinishReason | None]:
        """How many of ``sampled`` (completion tokens from number ``num_done`` on) the completion keeps, and why it
        ends there (None: it goes on). ``before``: the completion's tokens before ``sampled`` (its last ones will do),
        which a repetition may start in; read only where the request asked for repetition detection."""
        stop_ids, first = self.stop_ids, max(0, self.min_tokens - num_done - 1)
        end = len(sampled)
        if stop_ids and not stop_ids.isdisjoint(sampled):
            end = next((k for k in range(first, len(sampled)) if sampled[k] in stop_ids), end)
        if self.repetition is not None:  # as vLLM's, a stop token ends it first
            tokens = [*before[-self.repetition[1] * self.repetition[2]:], *sampled[:end]]
            for k in range(first, end):
                if repeats(tokens, len(tokens) - end + k + 1, *self.repetition):
                    return k + 1, FinishReason.REPETITION
        if end < len(sampled):
            return end + 1, FinishReason.STOP
        return len(sampled), FinishReason.LENGTH if num_done + len(sampled) >= self.max_completion else None

    def ends_by_length(self, num_completion: int) -> bool:
        """Whether a completion of this many tokens has reached its length."""
        return num_completion >= self.max_completion

    def before(self, token_ids: Sequence[int], num_prompt_tokens: int, slot: int) -> Sequence[int]:
        """``check``'s ``before`` for tokens sampled from ``slot`` on: the completion's last tokens a repetition may
        start in; none where the request asked for no repetition detection."""
        if self.repetition is None:
            return ()
        return token_ids[max(num_prompt_tokens, slot - self.repetition[1] * self.repetition[2]):slot]


def repeats(tokens: Sequence[int], end: int, min_size: int, max_size: int, count: int) -> bool:
    """Whether ``tokens[:end]`` ends with a pattern of ``min_size`` to ``max_size`` tokens repeated ``count`` times
    in a row (vLLM's check)."""
    for size in range(min_size, max_size + 1):
        if size * count > end:
            return False
        if all(tokens[end - n] == tokens[end - n - size * m] for n in range(1, size + 1) for m in range(1, count)):
            return True
    return False
