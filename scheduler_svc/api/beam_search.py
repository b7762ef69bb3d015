"""A beam search run through the engine as vLLM's OpenAI server runs one: every step, one request of one token per
live beam (its prompt the request's and the beam's tokens, so the prefix cache holds all but their last block),
asking for the next token's most likely alternatives (``core.beam_search`` decides which beams live on).

``BeamSearchGeneration`` is read as the HTTP routes read a ``frontend.Generation``: its one batch, every choice
whole, comes once the search ended. The steps' requests carry the request's id, so that aborting it by that id
ends the search (its beams answer as they are, with ``abort``, as vLLM's); a reader that goes away cancels the
step in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.beam_search import CANDIDATES_PER_BEAM, Beam, BeamSearch, BeamStart
from scheduler_svc.core.outputs import RequestOutput, RequestUsage
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.core.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class BeamSettings:
    """A request's beam search: ``width`` beams (its n), scored with ``length_penalty``; ``top_logprobs``: the
    alternatives each token's logprobs show (None: none asked)."""

    width: int
    length_penalty: float = 1.0
    include_stop: bool = False
    top_logprobs: int | None = None

    @property
    def alternatives(self) -> int:
        """The alternatives each step asks for: the search's candidates, or more where the answer shows more."""
        return max(CANDIDATES_PER_BEAM * self.width, self.top_logprobs or 0)


class OneRequest(Protocol):
    """A submitted request as the routes read it (``frontend.Generation``, ``api_http.LinkGeneration``)."""

    def batches(self) -> AsyncIterator[list[RequestOutput]]: ...

    def close(self) -> None: ...


class Searching(Protocol):
    """Where the steps go: the scheduler's frontend, or the API process's link to it."""

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart: ...

    async def submit_step(self, request: pb.GenerateRequest) -> OneRequest:
        """A step's request, read whole; one whose id was aborted while the last step's were held ends at once."""
        ...


class BeamSearchGeneration:
    """A beam search read as one request of ``settings.width`` choices."""

    def __init__(self, source: Searching, request: pb.GenerateRequest, start: BeamStart, settings: BeamSettings,
                 tokenizer: ModelTokenizer | None) -> None:
        self._source, self._request, self._tokenizer = source, request, tokenizer
        self.start, self.settings = start, settings
        self.num_prompt_tokens = len(start.prompt_token_ids)
        # Where the request asked for them (``return_prompt_token_ids``), else None.
        self.prompt_token_ids = start.prompt_token_ids if request.return_prompt_token_ids else None
        # The last step's requests, open until the next step's are in (or the search ends).
        self._held: list[OneRequest] = []

    @classmethod
    async def begin(cls, source: Searching, request: pb.GenerateRequest, settings: BeamSettings,
                    tokenizer: ModelTokenizer | None) -> BeamSearchGeneration:
        """Checked as a plain request would be (RequestFailed naming the field); nothing runs yet."""
        one = pb.GenerateRequest()
        one.CopyFrom(request)
        one.sampling.ClearField("n")
        return cls(source, request, await source.beam_start(one), settings, tokenizer)

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        search = BeamSearch(self.settings.width, self.start, self.settings.length_penalty, self.settings.include_stop)
        prompt: tuple[list[int], list] | None = None
        cached = 0
        try:
            while not search.done:
                first = search.steps == 0
                outputs = await self._step([self._one_token(beam, first) for beam in search.live])
                if first:
                    prompt, cached = outputs[0].prompt_logprobs, outputs[0].usage.cached_prompt_tokens
                if any(output.finish_reason is FinishReason.ABORT for output in outputs):
                    search.abort()
                    break
                search.advance([output.logprobs[0] for output in outputs])
        finally:
            self.close()
        yield [self._choice(i, beam, prompt, cached) for i, beam in enumerate(search.best())]

    def close(self) -> None:
        """Close the requests of the last step (cancelled where still running)."""
        held, self._held = self._held, []
        for generation in held:
            generation.close()

    async def _step(self, requests: list[pb.GenerateRequest]) -> list[RequestOutput]:
        """Every beam's next token. The step's requests are all in before the last step's close: an abort by the
        request's id always finds one (``Frontend.aborted``)."""
        submitted = [asyncio.ensure_future(self._source.submit_step(request)) for request in requests]
        try:
            await asyncio.wait(submitted)
        finally:
            self.close()
            self._held = [future.result() for future in submitted if future.done() and not future.cancelled()
                          and future.exception() is None]
            for future in submitted:
                future.cancel()
        reads = [asyncio.ensure_future(self._read(future.result())) for future in submitted]  # the first refusal raises
        try:
            return await asyncio.gather(*reads)
        finally:
            for read in reads:  # where one failed, the others' requests close cancelled, never to answer
                read.cancel()

    @staticmethod
    async def _read(generation: OneRequest) -> RequestOutput:
        """One beam's next token, its logprobs and alternatives; its prompt's logprobs where asked."""
        joined = RequestOutput()
        async for batch in generation.batches():
            for output in batch:
                joined.token_ids += output.token_ids
                joined.logprobs += output.logprobs
                joined.prompt_logprobs = joined.prompt_logprobs or output.prompt_logprobs
                joined.finish_reason, joined.usage = output.finish_reason, output.usage
        return joined

    def _one_token(self, beam: Beam, first: bool) -> pb.GenerateRequest:
        request = self._request
        one = pb.GenerateRequest(
            request_id=request.request_id, lora=request.lora, priority=request.priority, cache_salt=request.cache_salt,
            sampling=pb.SamplingOptions(temperature=0.0, logprobs=self.settings.alternatives),
            stopping=pb.StoppingOptions(max_tokens=1, ignore_eos=True))
        one.tokens.token_ids.extend(self.start.prompt_token_ids)
        one.tokens.token_ids.extend(beam.token_ids)
        if first and request.HasField("prompt_logprobs"):
            one.prompt_logprobs = request.prompt_logprobs
        return one

    def _choice(self, index: int, beam: Beam, prompt: tuple[list[int], list] | None, cached: int) -> RequestOutput:
        """The beam as choice ``index``'s one output: the first carries the prompt's usage and logprobs."""
        skip = self._request.skip_special_tokens if self._request.HasField("skip_special_tokens") else True
        text = self._tokenizer.decode(list(beam.token_ids), skip_special_tokens=skip) if self._tokenizer else ""
        usage = RequestUsage(self.num_prompt_tokens if index == 0 else 0, len(beam.token_ids),
                             cached if index == 0 else 0)
        return RequestOutput(text, list(beam.token_ids), list(beam.logprobs), beam.finish_reason, usage, index=index,
                             prompt_logprobs=prompt if index == 0 else None, matched_stop=beam.matched_stop)
