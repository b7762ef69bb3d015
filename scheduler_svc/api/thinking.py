"""Where structured output starts under ``--reasoning-parser``: after the model's thinking, as vLLM's does.

vLLM holds a request's grammar back while its reasoning parser reads thinking, so a model thinks freely and then
answers in the schema. Here the scheduler decides, per request, where the grammar starts, and the executor, which
masks, waits for it (``SamplingParams.grammar_after_token_ids`` / ``grammar_from_token_ids``):

* Unless the prompt closed the thinking already (its last marker of the turn ends it, as Qwen3's template writes
  ``<think>\\n\\n</think>`` with thinking off, vLLM's ``is_reasoning_end``), or the request asks for the grammar
  from the first token (``StructuredOutput.from_first_token``), the grammar waits.
* It starts after the completion's first ``</think>``, or, for ``qwen3``, at a ``<tool_call>`` (a call made without
  closing the thought, which the grammar then takes), as vLLM's parsers of those names end the thinking.
* ``qwen3`` reads the prompt back only to the current turn's start (``<|im_start|>``, ``<|im_end|>``), so an
  earlier turn's markers do not count, and ``enable_thinking: false`` in a chat prompt's template kwargs starts the
  grammar at once; ``deepseek_r1`` reads the whole prompt back.

A vocabulary without ``<think>`` and ``</think>`` as tokens has nothing to wait for: the grammar applies from the
first token, as without a parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.core.tokenizer import ModelTokenizer

START, END = "<think>", "</think>"
# By --reasoning-parser: what else ends the thinking (the answer's first token), and what marks a turn's edge.
PARSERS = {"qwen3": (("<tool_call>",), ("<|im_start|>", "<|im_end|>")), "deepseek_r1": ((), ())}


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids of one reasoning parser's markers in the model's vocabulary."""

    start: int
    # The answer follows these (``</think>``) or starts with them (``<tool_call>``).
    ends_after: tuple[int, ...]
    ends_at: tuple[int, ...]
    turn_edges: frozenset[int]
    # Whether the chat template's ``enable_thinking`` switches the thinking off (Qwen3's).
    switchable: bool

    @classmethod
    def of(cls, tokenizer: ModelTokenizer | None, parser: str) -> ThinkingMarkers | None:
        """``parser``'s markers, None without a parser or where the vocabulary lacks ``<think>`` or ``</think>``."""
        if not parser or tokenizer is None:
            return None
        start, end = tokenizer.token_id(START), tokenizer.token_id(END)
        if start is None or end is None:
            return None
        ends_at, edges = PARSERS[parser]
        ids = [tokenizer.token_id(marker) for marker in ends_at]
        return cls(start, (end,), tuple(i for i in ids if i is not None),
                   frozenset(i for i in map(tokenizer.token_id, edges) if i is not None), parser == "qwen3")

    def prompt_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt closed the thinking: read back, an end comes before a start or the turn's edge."""
        for token_id in reversed(prompt_token_ids):
            if token_id in self.ends_after or token_id in self.ends_at:
                return True
            if token_id == self.start or token_id in self.turn_edges:
                return False
        return False

    def waits(self, prompt_token_ids: Sequence[int], from_first_token: bool, thinking_off: bool) -> bool:
        """Whether a grammar waits for the thinking's end; ``thinking_off``: the request's ``enable_thinking`` is
        false (read by a switchable parser only)."""
        return not (from_first_token or (thinking_off and self.switchable) or self.prompt_ended(prompt_token_ids))
