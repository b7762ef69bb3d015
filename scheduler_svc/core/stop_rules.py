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
    # Where the completion starts in the sequence's tokens (``check``'s ``token_ids``).
    num_prompt_tokens: int = 0

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: Collection[int],
           max_model_len: int) -> StopRule:
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | frozenset(eos_token_ids)
        return cls(stop_ids, params.min_tokens, min(params.max_tokens, max_model_len - num_prompt_tokens),
                   params.repetition_detection, num_prompt_tokens)

    def check(self, sampled: Sequence[int], num_done: int,
              token_ids: Sequence[int] = ()) -> tuple[int, FinishReason | None]:
        """How many of ``sampled`` (completion tokens from number ``num_done`` on) the completion keeps, and why it
        ends there (None: it goes on). ``token_ids``: the sequence's tokens, its completion's before ``sampled``
        among them, where a repetition may start (read only where the request asked for repetition detection)."""
        if self.repetition is not None:
            return self._check_repetition(sampled, num_done, token_ids)
        stop_ids = self.stop_ids  # the common case, per token of every request: kept lean
        if stop_ids and not stop_ids.isdisjoint(sampled):
            for k in range(max(0, self.min_tokens - num_done - 1), len(sampled)):
                if sampled[k] in stop_ids:
                    return k + 1, FinishReason.STOP
        return len(sampled), FinishReason.LENGTH if num_done + len(sampled) >= self.max_completion else None

    def _check_repetition(self, sampled: Sequence[int], num_done: int,
                          token_ids: Sequence[int]) -> tuple[int, FinishReason | None]:
        """``check`` with vLLM's repetition detection, in vLLM's order: a stop token, then the length, then a
        repetition ends the completion."""
        first, end = max(0, self.min_tokens - num_done - 1), len(sampled)
        if not self.stop_ids.isdisjoint(sampled):
            end = next((k for k in range(first, end) if sampled[k] in self.stop_ids), end)
        done_at = self.num_prompt_tokens + num_done
        window = self.repetition[1] * self.repetition[2]
        tokens = [*token_ids[max(self.num_prompt_tokens, done_at - window):done_at], *sampled[:end]]
        for k in range(first, min(end, self.max_completion - num_done - 1)):  # the last token ends by length
            if repeats(tokens, len(tokens) - end + k + 1, *self.repetition):
                return k + 1, FinishReason.REPETITION
        if end < len(sampled):
            return end + 1, FinishReason.STOP
        return len(sampled), FinishReason.LENGTH if num_done + len(sampled) >= self.max_completion else None

    def ends_by_length(self, num_completion: int) -> bool:
        """Whether a completion of this many tokens has reached its length."""
        return num_completion >= self.max_completion


def repeats(tokens: Sequence[int], end: int, min_size: int, max_size: int, count: int) -> bool:
    """Whether ``tokens[:end]`` ends with a pattern of ``min_size`` to ``max_size`` tokens repeated ``count`` times
    in a row (vLLM's check)."""
    if min_size * count > end:
        return False
    last = tokens[end - 1]
    for size in range(min_size, max_size + 1):
        if size * count > end:
            return False
        if tokens[end - 1 - size] == last and all(tokens[end - n] == tokens[end - n - size * m]
                                                  for n in range(1, size + 1) for m in range(1, count)):
            return True
    return False
