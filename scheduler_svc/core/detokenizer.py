"""Completion tokens to text, one token at a time, emitting only text no later token can change.

Decoding token by token is wrong twice over: a multi-byte UTF-8 character may
be split across tokens (its first token decodes to U+FFFD), and tokenizers
such as SentencePiece render a token differently after another one (a leading
space). So each step decodes a small window, a few tokens already emitted
(the prefix) plus the new ones, and emits what the new tokens added, unless it
ends in U+FFFD, in which case it waits for the next token. Stop strings are
matched on that final text; text that could still become a stop string is held
back until the next token settles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from scheduler_svc.core.tokenizer import ModelTokenizer

# Prompt tokens decoded as left context of the first completion token.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Keeps only the window it decodes, so a step costs the same however long the text grows."""

    def __init__(self, tokenizer: ModelTokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self.window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # window[:num_prefix] was emitted already; window[num_prefix:] is waiting to become final text.
        self.num_prefix = len(self.window)
        self.prefix_text = self.decode(self.window)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        return self.push_many((token_id,))

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final. Several cost one decode (a multi-step window's tokens, for
        the price of one) unless their text ends inside a character: then each is pushed in turn, so that what
        came before that character is not held back with it."""
        if not token_ids:
            return ""
        self.window.extend(token_ids)
        text = self.decode(self.window)
        if text == self.prefix_text and self.num_prefix:
            # No visible effect after the prefix (skipped special tokens): dropping them keeps the
            # window short. Not at the very start, where a decoder may strip what a token shows.
            del self.window[-len(token_ids) :]
            return ""
        if len(token_ids) > 1 and text.endswith(REPLACEMENT_CHAR):
            del self.window[-len(token_ids) :]
            return "".join([self.push(token_id) for token_id in token_ids])
        if len(text) <= len(self.prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self.prefix_text) :]
        del self.window[: self.num_prefix]
        self.num_prefix = len(self.window)
        self.prefix_text = self.decode(self.window)
        return delta

    def flush(self) -> str:
        """The text of tokens still waiting, at the end of the generation (may hold U+FFFD)."""
        text = self.decode(self.window)
        delta = text[len(self.prefix_text) :]
        self.num_prefix, self.prefix_text = len(self.window), text
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, also when one spans several pushes."""

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self.stop = stop
        self.include_stop = include_stop
        self.held = ""
        # The stop string that ended the generation, once one did.
        self.matched: str | None = None

    def push(self, text: str, match: bool = True) -> tuple[str, bool]:
        """Return the text safe to emit and whether a stop string ended the generation.

        Text before the earliest stop string that ends in ``text`` is emitted (with the stop string when
        ``include_stop``), anything after it is dropped; a stop string may begin in text held back before. Without a
        match, the longest tail that is the start of some stop string is held back. ``match=False`` (a token within
        min_tokens) matches nothing, but holds its tail back all the same: as vLLM's, a stop string that begins
        within min_tokens and ends after it ends the generation.
        """
        if not self.stop:
            return text, False
        buffer = self.held + text
        if match:
            lead = len(self.held)  # held text was searched already: a new match ends past it
            found = ((buffer.find(s, max(0, lead - len(s) + 1)), s) for s in self.stop)
            if matches := [(i, -len(s)) for i, s in found if i >= 0]:
                self.held = ""
                start, minus_length = min(matches)
                self.matched = buffer[start : start - minus_length]
                return buffer[: start - minus_length if self.include_stop else start], True
        keep = max((self._partial_match(buffer, s) for s in self.stop), default=0)
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    @staticmethod
    def _partial_match(buffer: str, stop: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of ``stop``."""
        for k in range(min(len(stop) - 1, len(buffer)), 0, -1):
            if buffer.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        """The held-back text, final once no token follows."""
        held, self.held = self.held, ""
        return held


class TextStream:
    """One request's completion text: incremental detokenization followed by stop-string matching."""

    def __init__(self, tokenizer: ModelTokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_stop)

    def push(self, token_id: int, match: bool = True) -> tuple[str, bool]:
        """Text to emit for a new completion token, and whether a stop string was matched (never without
        ``match``)."""
        return self.matcher.push(self.detokenizer.push(token_id), match)

    @property
    def matches_stop_strings(self) -> bool:
        """Whether any stop string is watched for: else tokens need no matching and decode several at once."""
        return bool(self.matcher.stop)

    def push_many(self, token_ids: Sequence[int]) -> str:
        """The text of new completion tokens where no stop string is watched for (``matches_stop_strings``)."""
        return self.detokenizer.push_many(token_ids)

    def finish(self) -> tuple[str, bool]:
        """The remaining text once the generation ended, and whether a stop string was matched in it."""
        text, stopped = self.matcher.push(self.detokenizer.flush())
        return (text, True) if stopped else (text + self.matcher.flush(), False)

    def release(self) -> str:
        """Everything held back, unmatched, once the generation was cut short (aborted): no stop string can end it
        any more."""
        held = self.matcher.flush()
        return held + self.detokenizer.flush()
