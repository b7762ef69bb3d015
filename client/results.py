"""What a generation returns, as plain dataclasses instead of protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.v1 import generation_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_REPETITION: "repetition",
}


@dataclass
class Usage:
    """Token counts of one request; ``cached_prompt_tokens`` came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @classmethod
    def from_proto(cls, usage: pb.Usage) -> Usage:
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the most likely alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    # The tokens the model found at least as likely, itself included (vLLM's rank); None where the server does not say.
    rank: int | None = None

    @classmethod
    def from_proto(cls, lp: pb.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top],
                   lp.rank if lp.HasField("rank") else None)


@dataclass
class Chunk:
    """One streamed piece: the new text and token ids; the last chunk has ``finish_reason`` and ``usage``."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    usage: Usage | None
    # Which of the request's n choices this piece continues.
    index: int = 0
    # On the first chunk, when asked: prompt tokens from the second on, each with its logprob.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With finish_reason "stop": the stop string matched or the stop token id sampled; None for EOS (vLLM's).
    stop_reason: str | int | None = None
    # On the stream's first chunk, when asked (return_prompt_token_ids): the prompt's token ids.
    prompt_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_proto(cls, response: pb.GenerateResponse) -> Chunk:
        if not (response.finish_reason or response.logprobs or response.prompt_logprobs or response.prompt_token_ids):
            # most of a stream: tokens without logprobs, not the last chunk (read per token at many streams, W5 api)
            return cls(response.request_id, response.text, list(response.token_ids), [], None, None, response.index)
        return cls(
            request_id=response.request_id,
            text=response.text,
            token_ids=list(response.token_ids),
            logprobs=[TokenLogprob.from_proto(lp) for lp in response.logprobs],
            finish_reason=FINISH_REASONS[response.finish_reason],
            usage=Usage.from_proto(response.usage) if response.HasField("usage") else None,
            index=response.index,
            prompt_logprobs=[TokenLogprob.from_proto(lp) for lp in response.prompt_logprobs],
            stop_reason=stop_reason(response),
            prompt_token_ids=list(response.prompt_token_ids),
        )


@dataclass
class Completion:
    """A whole generation: the completion's text and token ids, why it stopped and its token counts."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # As Chunk's: what ended a "stop".
    stop_reason: str | int | None = None
    # When asked (return_prompt_token_ids): the prompt's token ids, the same for every choice.
    prompt_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_proto(cls, response: pb.GenerateResponse) -> Completion:
        chunk = Chunk.from_proto(response)
        return cls(chunk.request_id, chunk.text, chunk.token_ids, chunk.finish_reason, chunk.usage, chunk.logprobs,
                   chunk.index, chunk.prompt_logprobs, chunk.stop_reason, chunk.prompt_token_ids)

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> list[Completion]:
        """A stream's chunks as one completion per choice, in index order."""
        by_index: dict[int, Completion] = {}
        for c in chunks:
            done = by_index.setdefault(c.index, cls(c.request_id, "", [], None, None, [], c.index))
            done.text += c.text
            done.token_ids += c.token_ids
            done.logprobs += c.logprobs
            done.prompt_logprobs += c.prompt_logprobs
            done.finish_reason, done.usage = c.finish_reason or done.finish_reason, c.usage or done.usage
            done.stop_reason = c.stop_reason if c.finish_reason else done.stop_reason
        prompt = next((c.prompt_token_ids for c in chunks if c.prompt_token_ids), [])
        for done in by_index.values():
            done.prompt_token_ids = list(prompt)
        return [by_index[i] for i in sorted(by_index)]


def stop_reason(response: pb.GenerateResponse) -> str | int | None:
    """The response's stop string or stop token id, whichever is set; vLLM's "repetition_detected" for a completion
    its repetition detection ended."""
    if response.finish_reason == pb.FINISH_REASON_REPETITION:
        return "repetition_detected"
    kind = response.WhichOneof("stop_reason")
    return None if kind is None else getattr(response, kind)
