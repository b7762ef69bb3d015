"""Structured output in the executor: one llguidance matcher per request, its mask on the logits it samples.

The scheduler compiled and validated each grammar at request entry; here it meets the executor's own
tokenizer.json. Masking happens on this side of the wire so that overlap (a step in flight) and
multi-step decode (the executor feeds its own tokens) need no round trip: before the sampler, each
constrained row's logits outside the grammar's allowed tokens become -inf; after it, the matcher
consumes the sampled token. A matcher lives on its request's state, so it goes when the request goes;
a request that comes back (preemption, executor restart) has a fresh state and rebuilds its matcher
from its completion tokens. Once the grammar is complete (or the matcher failed) llguidance allows
only EOS, so the request ends as any other does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from executor_svc.core.request_table import RequestState

log = logging.getLogger("nanoserve.executor")


class GrammarConstraints:
    """Builds, masks with and advances the matchers of a model's requests."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        # Built at the first grammar (slow for a large vocabulary): most executors never need one.
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._bitmask = np.empty((0, (vocab_size + 31) // 32), dtype=np.int32)

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not self.tokenizer_path.is_file():
                raise FileNotFoundError(f"{self.tokenizer_path} is missing; structured output needs the tokenizer")
            self._tokenizer = llguidance.LLTokenizer(
                self.tokenizer_path.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def matcher(self, state: RequestState) -> llguidance.LLMatcher:
        """The request's matcher, built on first use and fed the completion tokens it already has."""
        if state.matcher is None:
            matcher = llguidance.LLMatcher(self.tokenizer(), state.sampling.grammar)
            completion = state.token_ids[state.num_prompt_tokens :]
            if completion and not matcher.is_error():
                matcher.consume_tokens(completion)
            if matcher.is_error():
                log.warning("request %d: its grammar allows only EOS now: %s", state.request_id, matcher.get_error())
            state.matcher = matcher
        return state.matcher

    @torch.inference_mode()  # the logits are inference tensors, updated in place
    def mask(self, logits: torch.Tensor, states: Sequence[RequestState]) -> list[int]:
        """Set to -inf, in place, the logits each constrained row's grammar does not allow (row i is states[i]);
        returns the constrained rows."""
        rows = [i for i, state in enumerate(states) if state.sampling.grammar is not None]
        if not rows:
            return rows
        matchers = [(self.matcher(states[i]), k) for k, i in enumerate(rows)]
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = np.empty((len(rows), self._bitmask.shape[1]), dtype=np.int32)
        bitmask = self._bitmask[: len(rows)]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        # One bit per token, lowest first: unpacked on the host in C, then one copy to the logits' device.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
        banned = torch.from_numpy(bits).view(torch.bool).to(logits.device, non_blocking=True).logical_not_()
        if len(rows) == len(states):
            logits.masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))
        return rows

    @staticmethod
    def advance(states: Sequence[RequestState], rows: list[int], token_ids: Sequence[int]) -> None:
        """Feed each constrained row's matcher the token sampled for it (a stopped one, past EOS, takes none)."""
        for i in rows:
            state, token_id = states[i], token_ids[i]
            matcher = state.matcher
            if not matcher.is_stopped() and not matcher.consume_token(token_id):
                log.warning("request %d: token %d broke its grammar: %s", state.request_id, token_id,
                            matcher.get_error())
