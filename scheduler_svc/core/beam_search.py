"""Beam search as vLLM's OpenAI server runs it: each step, every live beam asks the model for its next token's
most likely alternatives (a one-token request, ``api.beam_search``); the ``width`` best continuations by summed
logprob live on, and a continuation ending in an end token (EOS, a stop token) is completed. Once ``max_tokens``
steps ran, or no beam is left, the ``width`` best of the completed and live beams answer, each scored by its summed
logprob over its length (the prompt's included, as vLLM counts it) to the power ``length_penalty``.

The logprobs are the model's own (``raw_logprobs``), so the search is deterministic: sampling settings change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.step import TokenLogprobs
from scheduler_svc.core.sequence import FinishReason

# Each beam's candidates per step, per beam of the width (vLLM's): enough that ``width`` live beams remain even if
# every beam's best candidates end.
CANDIDATES_PER_BEAM = 2


@dataclass(frozen=True)
class BeamStart:
    """What the scheduler makes of a beam search's request before its first step: the prompt as the model reads it,
    the most tokens a beam may take, the tokens that end one and how many tokens a beam takes before one may end it
    (``min_tokens``)."""

    prompt_token_ids: list[int]
    max_tokens: int
    # The model's EOS tokens (none with ``ignore_eos``).
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0

    @property
    def end_token_ids(self) -> frozenset[int]:
        return self.eos_token_ids | self.stop_token_ids


@dataclass(frozen=True)
class Beam:
    """One hypothesis: its completion so far, each token's logprobs, and their sum."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    cum_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    # The end token that ended it, EOS included, as vLLM's beam search reports a choice's ``stop_reason``.
    matched_stop: int | None = None
    # Its tokens the score counts: all but an end token.
    num_scored: int = 0

    def extended(self, token_id: int, logprobs: TokenLogprobs) -> Beam:
        return Beam(self.token_ids + (token_id,), self.logprobs + (logprobs,), self.cum_logprob + logprobs.logprob,
                    num_scored=self.num_scored + 1)


@dataclass
class BeamSearch:
    """The search's state between steps: ``live`` beams ask for their next token; ``advance`` takes the answers."""

    width: int
    start: BeamStart
    length_penalty: float = 1.0
    # With vLLM's include_stop_str_in_output, a completed beam keeps its end token.
    include_stop: bool = False
    live: list[Beam] = field(default_factory=lambda: [Beam()])
    completed: list[Beam] = field(default_factory=list)
    steps: int = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.start.max_tokens

    def advance(self, alternatives: list[TokenLogprobs]) -> None:
        """``alternatives[i]``: the most likely next tokens after ``live[i]``, most likely first."""
        candidates: list[Beam] = []
        ends, count = self.start.end_token_ids, CANDIDATES_PER_BEAM * self.width
        for beam, top in zip(self.live, alternatives, strict=True):  # more alternatives than ``count`` are for show
            for token_id, logprob in zip(top.top_token_ids[:count], top.top_logprobs[:count], strict=True):
                rank = sum(other >= logprob for other in top.top_logprobs)  # as vLLM ranks: ties share the last
                chosen = TokenLogprobs(logprob, top.top_token_ids, top.top_logprobs, rank)
                if token_id not in ends:
                    candidates.append(beam.extended(token_id, chosen))
                elif len(beam.token_ids) >= self.start.min_tokens:
                    self.completed.append(self.ended(beam, token_id, chosen))
        if not candidates and not self.completed:  # every candidate an end before min_tokens: answer the beams
            self.completed = [replace(beam, finish_reason=FinishReason.LENGTH) for beam in self.live]
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.live = candidates[:self.width]
        self.steps += 1

    def ended(self, beam: Beam, token_id: int, logprobs: TokenLogprobs) -> Beam:
        kept = beam.extended(token_id, logprobs)
        return replace(kept, token_ids=kept.token_ids if self.include_stop else beam.token_ids,
                       finish_reason=FinishReason.STOP, num_scored=beam.num_scored, matched_stop=token_id)

    def abort(self) -> None:
        """A step's request was aborted: the live beams end as they are (vLLM's)."""
        self.completed += [replace(beam, finish_reason=FinishReason.ABORT) for beam in self.live]
        self.live = []

    def score(self, beam: Beam) -> float:
        length = len(self.start.prompt_token_ids) + beam.num_scored
        return beam.cum_logprob / max(length, 1) ** self.length_penalty

    def best(self) -> list[Beam]:
        """The answer: the ``width`` best beams, best first (fewer where fewer are left: an abort in the first step,
        ``min_tokens`` against a vocabulary of end tokens); a beam still live ended by its length."""
        final = self.completed + [replace(beam, finish_reason=FinishReason.LENGTH) for beam in self.live]
        return sorted(final, key=self.score, reverse=True)[:self.width]
