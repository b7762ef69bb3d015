"""Speculative decoding on the scheduler's side: which sequences propose, how many tokens, and the back-off.

A decode row with k proposals computes 1 + k tokens (its last token, then the proposals) and reserves their KV slots;
the executor verifies them in one forward pass and samples 1 ..= k + 1 tokens (the proposals it accepts, then one of
its own), and the scheduler gives back the slots and blocks of those it rejected (``core.verification``).

Which sequences speculate: those that can gain from it. Off for a request with n > 1 (its choices already share each
forward pass, which is what a proposal would otherwise make use of) and with prompt logprobs (a scoring request).
Logprobs, a grammar and logits processors (penalties, logit bias, min_tokens) speculate: the executor samples each
verified position with the context a plain decode would have there (docs/executor.md), so their tokens are exact.

The back-off: a sequence proposes ``draft_len`` tokens at most, starting at k (n-gram) or 1 (a draft model, whose
proposals cost a pass each); all accepted, it proposes one more next time (up to k); otherwise one more than were
accepted, and when none was, it stops proposing for 8, 16, 32 .. 256 of its tokens (doubling while its proposals keep
failing), then tries one proposal. Above ``speculative_disable_by_batch_size`` running sequences nothing is proposed
(on a CPU executor 4 by default: ``engine.checks``).

Overlap and multi-step: a plan with proposals is one decode step (no window), and a sequence verifying is held until
its result, since the next plan starts where verification ended. A sequence whose decode is in flight cannot propose
(its last token is not known yet): when one verifies, or its settled tokens already match an n-gram (so that it would
propose once its token in flight is known), every decode in flight waits for its step, so the batch stays one step
and the next plan proposes; otherwise decodes are planned ahead (overlap) and in windows as without speculation. A
plan booked on a window in flight proposes nothing (a cut window drops it whole).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_svc.core.ngram import NgramIndex
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import PENDING, Sequence

# The most tokens of its own a sequence whose proposals keep failing waits before it proposes again.
MAX_SKIP_TOKENS = 256


def speculation_allowed(params: SamplingParams) -> bool:
    """Whether a request's sequences may speculate (the module docstring says why not, where not)."""
    return params.n == 1 and params.prompt_logprobs is None


@dataclass(slots=True)
class SequenceSpeculation:
    """One sequence's proposer state: its n-gram index (n-gram proposals) and its back-off."""

    draft_len: int
    index: NgramIndex | None = None
    # The completion length before which it does not propose; and its verifications in a row that accepted nothing.
    skip_until: int = 0
    misses: int = 0


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: verifications with proposals, tokens proposed and accepted, and accepted tokens
    by position in the proposal (0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Proposes for the running sequences before each decode, and learns from each verification."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.method = config.speculative
        self.k = config.num_speculative_tokens
        self.ngram_window = (config.ngram_min, config.ngram_max)
        self.disable_by_batch_size = config.speculative_disable_by_batch_size
        self.counters = SpecCounters(accepted_per_position=[0] * self.k)

    def attach(self, seq: Sequence) -> None:
        """Give a queued sequence its proposer state, where its request may speculate."""
        if seq.speculation is None and seq.speculate and speculation_allowed(seq.params):
            index = NgramIndex(*self.ngram_window) if self.method == "ngram" else None
            # A draft model's proposals cost a pass each: its sequences start with one and earn more.
            seq.speculation = SequenceSpeculation(self.k if index is not None else 1, index)

    def propose(self, running: deque[Sequence], seq_budget: int, token_budget: int,
                may_propose: bool = True) -> tuple[bool, bool]:
        """Set each settled running sequence's proposals for the coming decode (``num_draft_tokens``,
        ``draft_token_ids``) within the token budget (one token kept for every sequence that may decode); with
        ``may_propose`` False (a plan booked on a window in flight) none. Returns whether the decodes in flight must
        be held, and whether anything was proposed: a sequence with a decode in flight cannot propose (its tokens
        are not known), and when one verifies or would propose, every decode in flight waits for its result."""
        disabled = self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size
        hold = False
        spare = initial = token_budget - min(len(running), seq_budget)
        ngram = self.method == "ngram"
        for seq in running:  # proposals of a step a sequence was left out of go too
            seq.num_draft_tokens = 0
            seq.draft_token_ids = []
            tokens = seq.token_ids
            if disabled or seq.final_token_pending:
                continue
            if tokens[-1] == PENDING:
                hold = hold or self._would_propose(seq)
                continue
            state = seq.speculation
            if not may_propose or state is None or spare <= 0 or state.skip_until > seq.num_completion_tokens:
                continue
            num_tokens = len(tokens)
            # The verification samples up to limit + 1 tokens, never past the completion's length.
            limit = min(state.draft_len, spare, seq.stop_rule.max_completion - (num_tokens - seq.num_prompt_tokens) - 1)
            if limit <= 0:
                continue
            if ngram:
                drafts = state.index.propose(tokens, num_tokens, limit)
                seq.draft_token_ids = drafts
                seq.num_draft_tokens = len(drafts)
            else:
                seq.num_draft_tokens = limit
            spare -= seq.num_draft_tokens
        return hold, spare < initial

    def _would_propose(self, seq: Sequence) -> bool:
        """Whether ``seq`` verifies now, or would propose once its tokens in flight are known."""
        if seq.verifying:
            return True
        state = seq.speculation
        if state is None or state.skip_until > seq.num_completion_tokens:
            return False
        if state.index is None:
            return True
        tokens = seq.token_ids
        known = len(tokens)
        while tokens[known - 1] == PENDING:
            known -= 1
        return state.index.matches(tokens, known)

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` proposals accepted ``num_accepted``: counted, and the back-off learns."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_tokens += num_accepted
        per_position = counters.accepted_per_position
        for i in range(num_accepted):
            per_position[i] += 1
        state = seq.speculation
        if state is None:
            return
        if num_accepted == num_drafts:
            state.draft_len = min(self.k, state.draft_len + 1)
            state.misses = 0
            return
        state.draft_len = num_accepted + 1  # after a miss, the next try is one proposal: a cheap probe
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.skip_until = seq.num_completion_tokens + min(4 << state.misses, MAX_SKIP_TOKENS)

    @property
    def acceptance_rate(self) -> float:
        """Accepted tokens per proposed token since start (0 before any)."""
        counters = self.counters
        return counters.num_accepted_tokens / counters.num_draft_tokens if counters.num_draft_tokens else 0.0
