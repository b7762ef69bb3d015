"""Structured output in the executor: one llguidance matcher per request, its mask on the logits it samples.

The scheduler compiled and validated each grammar at request entry; here it meets the executor's own
tokenizer.json. Masking happens on this side of the wire so that overlap (a step in flight) and
multi-step decode (the executor feeds its own tokens) need no round trip: before the sampler, each
constrained row's logits outside the grammar's allowed tokens become -inf; after it, the matcher
consumes the sampled token. A matcher lives on its request's state, so it goes when the request goes;
a request that comes back (preemption, executor restart) has a fresh state and rebuilds its matcher
from its completion tokens. Once the grammar is complete (or the matcher failed) llguidance allows
only EOS, so the request ends as any other does.

Under the scheduler's reasoning parser a grammar waits for the model's thinking to end, as vLLM's
structured output does: nothing is masked until the completion holds one of the sampling settings'
``grammar_after_token_ids`` (``</think>``), and the grammar then follows the tokens after it.
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

    def build(self, state: RequestState, tokens: Sequence[int]) -> llguidance.LLMatcher:
        """A matcher for ``state``'s grammar that has consumed ``tokens``, kept on the state."""
        matcher = llguidance.LLMatcher(self.tokenizer(), state.sampling.grammar)
        if tokens and not matcher.is_error():
            matcher.consume_tokens(list(tokens))
        if matcher.is_error():
            log.warning("request %d: its grammar allows only EOS now: %s", state.request_id, matcher.get_error())
        state.matcher = matcher
        return matcher

    def matcher(self, state: RequestState) -> llguidance.LLMatcher | None:
        """The request's matcher, built on first use and fed the completion tokens it already has (those after the
        thinking's end, where its grammar waits for that); None while the grammar waits."""
        if state.matcher is not None or state.grammar_waits:
            return state.matcher
        completion = state.token_ids[state.num_prompt_tokens :]
        if after := state.sampling.grammar_after_token_ids:
            end = next((k for k, t in enumerate(completion) if t in after), None)
            state.grammar_waits = end is None
            if end is None:
                return None
            completion = completion[end + 1 :]
        return self.build(state, completion)

    @torch.inference_mode()  # the logits are inference tensors, updated in place
    def mask(self, logits: torch.Tensor, states: Sequence[RequestState]) -> list[int]:
        """Set to -inf, in place, the logits each constrained row's grammar does not allow (row i is states[i]);
        returns the rows with a grammar, those that wait for the thinking's end too (``advance`` takes them all)."""
        rows = [i for i, state in enumerate(states) if state.sampling.grammar is not None]
        masked = [i for i in rows if self.matcher(states[i]) is not None]
        if masked:
            self._mask(logits, states, masked)
        return rows

    def _mask(self, logits: torch.Tensor, states: Sequence[RequestState], rows: list[int]) -> None:
        matchers = [(states[i].matcher, k) for k, i in enumerate(rows)]
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

    def advance(self, states: Sequence[RequestState], rows: list[int], token_ids: Sequence[int]) -> None:
        """Feed each constrained row's matcher the token sampled for it (a stopped one, past EOS, takes none); a
        grammar waiting for the thinking's end starts at the token that ends it."""
        for i in rows:
            state, token_id = states[i], token_ids[i]
            matcher = state.matcher
            if matcher is None:
                if token_id in state.sampling.grammar_after_token_ids:
                    state.grammar_waits = False
                    self.build(state, [])
                continue
            if not matcher.is_stopped() and not matcher.consume_token(token_id):
                log.warning("request %d: token %d broke its grammar: %s", state.request_id, token_id,
                            matcher.get_error())
