"""The engine loop's outputs out, as VllmEngine's GenerateResponses: token ids only (the gateway detokenizes).

Streamed (``stream``), each choice's new tokens go in a ``GenerateStreamChunk`` as they come (a delta, as vLLM
streams), and its end in a ``GenerateComplete``: the finish reason, what stopped it, the prompt's length and its
cached tokens. Not streamed, each choice gets one ``GenerateComplete`` with all of its tokens once it ended. The
prompt is counted on every choice (the gateway takes the largest, as it does vLLM's); only choice 0 reports the
prompt tokens it found in the prefix cache, the others hit choice 0's own blocks.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from smg_grpc_proto import vllm_engine_pb2 as vllm

from common.step import TokenLogprobs
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.sequence import FinishReason

FINISH_REASONS = {reason: reason.value for reason in FinishReason}


def top_logprobs(lp: TokenLogprobs) -> vllm.TopLogProbs:
    return vllm.TopLogProbs(values=lp.top_logprobs, token_ids=lp.top_token_ids)


def output_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs], with_top: bool) -> vllm.OutputLogProbs:
    out = vllm.OutputLogProbs(token_ids=token_ids, token_logprobs=[lp.logprob for lp in logprobs])
    if with_top:
        out.top_logprobs.extend(top_logprobs(lp) for lp in logprobs)
    return out


def input_logprobs(prompt_ids: list[int], logprobs: list[TokenLogprobs], with_top: bool) -> vllm.InputLogProbs:
    """One entry per prompt token scored; the first has no logprob (nothing came before it)."""
    out = vllm.InputLogProbs(token_ids=prompt_ids[: len(logprobs) + 1])
    out.token_logprobs.append(vllm.InputTokenLogProb())
    out.token_logprobs.extend(vllm.InputTokenLogProb(value=lp.logprob) for lp in logprobs)
    if with_top:
        out.top_logprobs.append(vllm.TopLogProbs())
        out.top_logprobs.extend(top_logprobs(lp) for lp in logprobs)
    return out


class ResponseWriter:
    """One Generate call: its outputs, batch by batch, as the responses to send."""

    def __init__(self, prompt_ids: list[int], stream: bool, with_logprobs: bool, with_top: bool,
                 with_prompt_top: bool) -> None:
        self.prompt_ids = prompt_ids
        self.stream = stream
        self.with_logprobs, self.with_top, self.with_prompt_top = with_logprobs, with_top, with_prompt_top
        self.input_logprobs: vllm.InputLogProbs | None = None
        # Per choice: every token so far, and its logprobs (when asked); the choices that sent a chunk.
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.logprobs: dict[int, list[TokenLogprobs]] = defaultdict(list)
        self.chunked: set[int] = set()

    @staticmethod
    def reading(prepared: PreparedRequest) -> tuple[list[int], bool, bool, bool]:
        """What a writer needs of the request besides ``stream`` (the API process gets it over the link)."""
        params = prepared.params
        return (prepared.prompt_token_ids, params.logprobs is not None, bool(params.logprobs),
                bool(params.prompt_logprobs))

    @classmethod
    def of(cls, prepared: PreparedRequest, stream: bool) -> ResponseWriter:
        prompt_ids, with_logprobs, with_top, with_prompt_top = cls.reading(prepared)
        return cls(prompt_ids, stream, with_logprobs, with_top, with_prompt_top)

    def responses(self, outputs: list[RequestOutput]) -> list[vllm.GenerateResponse]:
        """A batch of outputs (several choices, in order) as chunks and completes."""
        answers = []
        for index, run in itertools.groupby(outputs, key=lambda output: output.index):
            run = list(run)
            new = [t for output in run for t in output.token_ids]
            new_logprobs = [lp for output in run for lp in output.logprobs]
            if run[0].prompt_logprobs is not None:
                self.input_logprobs = input_logprobs(self.prompt_ids, run[0].prompt_logprobs[1], self.with_prompt_top)
            self.tokens[index] += new
            self.logprobs[index] += new_logprobs
            if self.stream and new:
                answers.append(vllm.GenerateResponse(chunk=self._chunk(index, new, new_logprobs)))
            last = run[-1]
            if last.finish_reason is not None:
                answers.append(vllm.GenerateResponse(complete=self._complete(index, last)))
        return answers

    def _chunk(self, index: int, token_ids: list[int], logprobs: list[TokenLogprobs]) -> vllm.GenerateStreamChunk:
        chunk = vllm.GenerateStreamChunk(token_ids=token_ids, prompt_tokens=len(self.prompt_ids),
                                         completion_tokens=len(token_ids), index=index)
        if self.with_logprobs and logprobs:
            chunk.output_logprobs.CopyFrom(output_logprobs(token_ids[: len(logprobs)], logprobs, self.with_top))
        if index not in self.chunked:
            self.chunked.add(index)
            if self.input_logprobs is not None:
                chunk.input_logprobs.CopyFrom(self.input_logprobs)
        return chunk

    def _complete(self, index: int, last: RequestOutput) -> vllm.GenerateComplete:
        token_ids, usage = self.tokens.pop(index), last.usage
        complete = vllm.GenerateComplete(
            output_ids=token_ids, finish_reason=FINISH_REASONS[last.finish_reason],
            prompt_tokens=len(self.prompt_ids), completion_tokens=usage.completion_tokens if usage else len(token_ids),
            cached_tokens=usage.cached_prompt_tokens if usage else 0, index=index)
        logprobs = self.logprobs.pop(index, [])
        if self.with_logprobs and logprobs:
            complete.output_logprobs.CopyFrom(output_logprobs(token_ids[: len(logprobs)], logprobs, self.with_top))
        if self.input_logprobs is not None:
            complete.input_logprobs.CopyFrom(self.input_logprobs)
        if isinstance(last.matched_stop, str):
            complete.matched_stop_str = last.matched_stop
        elif last.matched_stop is not None:
            complete.matched_token_id = last.matched_stop
        return complete
