"""Where structured output starts under ``--reasoning-parser``: after the model's thinking, as vLLM's does.

vLLM holds a request's grammar back while its reasoning parser reads thinking, so a model thinks freely and then
answers in the schema. Here the scheduler decides, per request, whether the grammar waits, and the executor, which
masks, waits for the completion's ``</think>`` (``SamplingParams.grammar_after_token_ids``):

* Unless the prompt closed the thinking already (read back, an end comes first: Qwen3's template writes
  ``<think>\\n\\n</think>`` with thinking off; vLLM's ``is_reasoning_end``), or the request asks for the grammar
  from the first token (``StructuredOutput.from_first_token``), the grammar waits.
* ``qwen3`` reads the prompt back only to the current turn's start (``<|im_start|>``, ``<|im_end|>``), so an
  earlier turn's markers do not count, and ``<tool_call>`` there ends the thinking too; ``enable_thinking: false``
  in a chat prompt's template kwargs starts the grammar at once. ``deepseek_r1`` reads the whole prompt back.
* In the completion only ``</think>`` starts the grammar. Qwen3's parser also ends the thinking at a
  ``<tool_call>`` (a call made without closing the thought), where vLLM's grammar starts with that token; none of
  the grammars here (a schema, a regex, a forced call's JSON) can take it, and vLLM fails such a request, so the
  grammar here waits on for ``</think>``.

A vocabulary without ``<think>`` and ``</think>`` as tokens has nothing to wait for: the grammar applies from the
first token, as without a parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.core.tokenizer import ModelTokenizer

START, END = "<think>", "</think>"
# By --reasoning-parser: what else ends the thinking in a prompt, and what marks a turn's edge.
PARSERS = {"qwen3": (("<tool_call>",), ("<|im_start|>", "<|im_end|>")), "deepseek_r1": ((), ())}


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids of one reasoning parser's markers in the model's vocabulary."""

    start: int
    end: int
    # What else ends the thinking, read in a prompt (Qwen3's ``<tool_call>``).
    other_ends: frozenset[int]
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
        other_ends, edges = PARSERS[parser]
        ids = [tokenizer.token_id(marker) for marker in (*other_ends, *edges)]
        found = [frozenset(i for i in ids[:len(other_ends)] if i is not None),
                 frozenset(i for i in ids[len(other_ends):] if i is not None)]
        return cls(start, end, *found, parser == "qwen3")

    def prompt_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt closed the thinking: read back, an end comes before a start or the turn's edge."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end or token_id in self.other_ends:
                return True
            if token_id == self.start or token_id in self.turn_edges:
                return False
        return False

    def waits(self, prompt_token_ids: Sequence[int], from_first_token: bool, thinking_off: bool) -> bool:
        """Whether a grammar waits for the thinking's end; ``thinking_off``: the request's ``enable_thinking`` is
        false (read by a switchable parser only)."""
        return not (from_first_token or (thinking_off and self.switchable) or self.prompt_ended(prompt_token_ids))
