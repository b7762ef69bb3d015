"""``--reasoning-parser``: the thinking a model writes before its answer (``<think>...</think>``) taken out of the
content into the message's ``reasoning``, whole and streamed, as vLLM's parsers of the same names take it.

* ``qwen3`` (Qwen3, QwQ): the answer starts in thinking, unless the request's ``chat_template_kwargs`` turn
  ``enable_thinking`` off; ``</think>`` ends it, and so does ``<tool_call>``, which stays in the content (a call made
  without closing the thought). ``<think>`` is dropped while thinking; read whole, every ``</think>`` after the
  thought is dropped from the content too.
* ``deepseek_r1`` (DeepSeek-R1 and its distillations, whose template opens ``<think>`` in the prompt): the answer is
  thinking up to the first ``</think>`` (all of it if none comes); read whole, text up to a ``<think>`` the answer
  opens is dropped, as vLLM drops it.

Streamed, the markers are found in the text, as vLLM finds their tokens one by one: text that could be the start of
a marker waits for the next delta, and a marker split across deltas still counts; once the thinking ended the rest
is content as it comes. ``ReasoningTokens`` counts the thinking's tokens for ``usage.completion_tokens_details``.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.api.http.tool_calls import tag_overlap
from scheduler_svc.core.tokenizer import ModelTokenizer

START, END, TOOL_CALL, TOOL_CALL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"


@dataclass
class Step:
    """What one streamed delta gave: thinking, and (once it ended) the content after it."""

    reasoning: str = ""
    content: str = ""
    ended: bool = False


class ThinkingStream:
    """The thinking of one choice, delta by delta; ``ENDS`` are the markers that end it (kept in the content when
    ``KEPT``)."""

    ENDS: tuple[str, ...] = (END,)
    KEPT: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.held = ""

    def feed(self, delta: str) -> Step:
        text, self.held = self.held + delta, ""
        step, pos = Step(), 0
        while True:
            found = [(i, marker) for marker in (START, *self.ENDS) if (i := text.find(marker, pos)) >= 0]
            if not found:
                cut = len(text) - max(tag_overlap(text[pos:], marker) for marker in (START, *self.ENDS))
                step.reasoning += text[pos:cut]
                self.held = text[cut:]
                return step
            i, marker = min(found)
            step.reasoning += text[pos:i]
            pos = i + len(marker)
            if marker != START:
                step.content = self.after_end(marker if marker in self.KEPT else "", text[pos:])
                step.ended = True
                return step

    def after_end(self, kept: str, rest: str) -> str:
        return kept + rest

    def finish(self) -> str:
        """What waited for a marker that never came: thinking."""
        held, self.held = self.held, ""
        return held


class Qwen3Stream(ThinkingStream):
    ENDS = (END, TOOL_CALL)
    KEPT = (TOOL_CALL,)

    def after_end(self, kept: str, rest: str) -> str:
        return kept + rest.replace(END, "")


class Qwen3Reasoning:
    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking

    def whole(self, text: str) -> tuple[str | None, str | None]:
        if not self.thinking:
            return None, text
        stream = Qwen3Stream()
        step = stream.feed(text)
        if not step.ended:
            return (step.reasoning + stream.finish()) or None, None
        return step.reasoning or None, step.content.replace(END, "") or None

    def stream(self) -> ThinkingStream | None:
        """None: the answer does not think (thinking turned off), so it is all content."""
        return Qwen3Stream() if self.thinking else None


class DeepSeekR1Reasoning:
    def __init__(self, thinking: bool = True) -> None:
        """``thinking`` is Qwen3's switch; R1's thinking is always on."""

    def whole(self, text: str) -> tuple[str | None, str | None]:
        before, start, after = text.partition(START)
        text = after if start else before
        if END not in text:
            return text, None
        reasoning, _, content = text.partition(END)
        return reasoning, content or None

    def stream(self) -> ThinkingStream | None:
        return ThinkingStream()


REASONING_PARSERS: dict[str, type[Qwen3Reasoning] | type[DeepSeekR1Reasoning]] = {
    "qwen3": Qwen3Reasoning, "deepseek_r1": DeepSeekR1Reasoning}


class ReasoningTokens:
    """How many of a choice's tokens are its thinking, added token by token, as vLLM counts them: ``qwen3`` the
    tokens before the one that ends it (its markers' tokens not counted), ``deepseek_r1`` those between ``<think>``
    and ``</think>`` tokens the answer itself holds."""

    def __init__(self, parser: str, thinking: bool, tokenizer: ModelTokenizer | None) -> None:
        self.parser, self.tokenizer = parser, tokenizer
        self.open = parser == "qwen3" and thinking
        self.depth = 0
        self.count = 0

    def add(self, token_ids: list[int]) -> int:
        if self.tokenizer is None:
            return self.count
        for token_id in token_ids:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if self.parser == "qwen3":
                if text in (END, TOOL_CALL):
                    self.open = False
                self.count += self.open and text not in (START, TOOL_CALL_END)
            elif text == START:
                self.depth += 1
            elif text == END:
                self.depth = max(self.depth - 1, 0)
            else:
                self.count += self.depth > 0
        return self.count
