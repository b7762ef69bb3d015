"""Output processing, one request at a time: tokens to text, stop strings, finish reason and usage.

It reads the sequence but never changes it: where a stop string ends a request before the
last token the step sampled, it returns the position to stop at, and the loop applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.step import TokenLogprobs
from scheduler_svc.core.detokenizer import TextStream
from scheduler_svc.core.errors import InvalidRequest, RequestFailed
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import TokenOutput
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.core.tokenizer import ModelTokenizer

# vLLM's stop_reason of a completion its repetition_detection ended.
REPETITION_DETECTED = "repetition_detected"


@dataclass(frozen=True)
class RequestUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @classmethod
    def of(cls, seq: Sequence, counts_prompt: bool = True) -> RequestUsage:
        """``seq``'s so far; ``counts_prompt`` False for choices after the first, which share the first's prompt."""
        if not counts_prompt:
            return cls(0, seq.num_completion_tokens, 0)
        return cls(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_prefix_hit_tokens or 0)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request; the last one carries finish_reason and usage, or an error."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: RequestUsage | None = None
    error: RequestFailed | None = None
    # Which of the request's n choices this continues.
    index: int = 0
    # On the first output of a request that asked: its prompt tokens, and the logprobs of the second on.
    prompt_logprobs: tuple[list[int], list[TokenLogprobs]] | None = None
    # An ABORT because the server shut down before the request finished: the caller may resume it elsewhere.
    drained: bool = False
    # With a STOP: the stop string matched, or the stop token id sampled (None for an EOS token).
    matched_stop: str | int | None = None


class OutputProcessor:
    """Turns one choice's sampled tokens into text; without a tokenizer there is no text and no stop string.

    ``index`` is the choice (of the request's n); only choice 0's usage counts the prompt (and its prefix-cache
    hits), so that the usage of a request's choices adds up to its prompt once. ``resumed`` completion tokens
    (a stream another scheduler started) are replayed through the text state, their text dropped: the
    caller has it, and text held back at the boundary (a partial stop string, an unfinished character)
    comes out with the next token, exactly as in an undisturbed run. The token that ends a STOP (EOS, a stop
    token) shows its text only with ``include_stop_str_in_output``, as vLLM's detokenizer has it (an EOS, being a
    special token, then shows only without ``skip_special_tokens``).
    """

    def __init__(self, tokenizer: ModelTokenizer | None, prompt_token_ids: list[int], params: SamplingParams,
                 index: int = 0, resumed: list[int] | None = None) -> None:
        self.text = None if tokenizer is None else TextStream(
            tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        self.index = index
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.prompt_logprobs_due = params.prompt_logprobs is not None
        if self.text is not None:
            for k, token_id in enumerate(resumed or ()):
                if self.text.push(token_id, k >= self.min_tokens)[1]:
                    raise InvalidRequest("resume.completion_token_ids", f"a stop string ends the generation at "
                                                                        f"resumed token {k}: nothing left to resume")

    def process(self, out: TokenOutput) -> tuple[RequestOutput, int | None]:
        """The caller's output of a step's tokens, and where the loop must end the sequence (None: nowhere).

        It runs for every choice every step, on the thread that plans the next step: a plain tuple, and the
        outputs' fields given in order (W5 ``api``)."""
        seq, token_ids, final = out.seq, out.token_ids, out.final
        text, stop_at = "", None
        reason = seq.finish_reason if final else None
        if self.text is not None:
            text, token_ids, stopped, stop_at = self._text(out)
            if stopped:
                reason = FinishReason.STOP
        logprobs = out.logprobs[: len(token_ids)] if out.logprobs and seq.params.logprobs is not None else []
        usage = None
        if reason is not None:
            # Counted up to the last token kept, which is also where a stop string ends the sequence.
            num_completion = out.position + len(token_ids) - seq.num_prompt_tokens
            prompt = (seq.num_prompt_tokens, seq.num_prefix_hit_tokens or 0) if self.index == 0 else (0, 0)
            usage = RequestUsage(prompt[0], num_completion, prompt[1])
        prompt_logprobs = None
        if self.prompt_logprobs_due:
            self.prompt_logprobs_due = False
            prompt_logprobs = (seq.token_ids[: seq.num_prompt_tokens], seq.prompt_logprobs)
        output = RequestOutput(text, token_ids, logprobs, reason, usage, None, self.index, prompt_logprobs)
        if reason is FinishReason.STOP:
            output.matched_stop = self._matched_stop(seq, token_ids)
        elif reason is FinishReason.REPETITION:
            output.matched_stop = REPETITION_DETECTED
        return output, stop_at

    def release(self) -> str:
        """The text held back (a partial stop string, an unfinished character) when the choice is aborted: no token
        follows, so no stop string can match it any more and it is final."""
        return "" if self.text is None else self.text.release()

    def _matched_stop(self, seq: Sequence, token_ids: list[int]) -> str | int | None:
        """What ended a STOP: a stop string, or a stop token id (not an EOS, which the model ends on by itself)."""
        if self.text is not None and self.text.matcher.matched is not None:
            return self.text.matcher.matched
        last = token_ids[-1] if token_ids else None
        return last if last in seq.params.stop_token_ids else None

    def _text(self, out: TokenOutput) -> tuple[str, list[int], bool, int | None]:
        """The text of a step's tokens, the tokens kept (up to a stop string), whether one matched, and where the
        sequence must end when it matched before the step's last token."""
        seq, token_ids = out.seq, out.token_ids
        last = len(token_ids) - 1
        # The EOS or stop token that ends the generation shows no text, unless include_stop_str_in_output.
        hides_last = out.final and seq.finish_reason is FinishReason.STOP and not self.include_stop
        if not self.text.matches_stop_strings:  # a window's tokens decode at once
            shown = last if hides_last else last + 1
            text = self.text.push_many(token_ids[:shown])
            if out.final:
                text += self.text.finish()[0]
            return text, token_ids, False, None
        text, stopped, stop_at = "", False, None
        # Completion tokens before token k: a stop string ends the generation once it ends past min_tokens tokens.
        done = out.position - seq.num_prompt_tokens
        for k, token_id in enumerate(token_ids):
            if k == last and hides_last:
                break
            piece, stopped = self.text.push(token_id, done + k >= self.min_tokens)
            text += piece
            if stopped:
                if k < last or not out.final:
                    stop_at = out.position + k
                token_ids = token_ids[: k + 1]
                break
        if not stopped and out.final:
            tail, stopped = self.text.finish()
            text += tail
        return text, token_ids, stopped, stop_at
