"""The plain values the executor's core works on, free of protobuf and torch.

``executor_svc.core.codec`` translates them to and from the proto; the request table,
the sampler and the step code see only these. Torch-free, so the model-free
executors stay so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing by them would overflow the logits.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """One request's sampling settings; the defaults are the proto's for absent fields.

    ``greedy``, ``plain_greedy`` (greedy without logprobs or logits processors, the sampler's fast path),
    ``has_logits_processors`` and ``penalized`` are checked for every row every step, so they are worked out
    once, when the request arrives.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs, ids ascending: a tuple keeps the settings immutable and hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # An llguidance grammar (JSON form) the sampled tokens follow; the model runner masks the logits with it.
    grammar: str | None = None
    # Score the prompt's tokens with this many alternatives each (``prompt_logprobs``).
    num_prompt_logprobs: int | None = None
    greedy: bool = field(init=False, repr=False, compare=False)
    plain_greedy: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)
    has_logits_processors: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        processors = penalized or bool(self.logit_bias) or self.min_tokens > 0
        object.__setattr__(self, "greedy", self.temperature < GREEDY_BELOW)
        object.__setattr__(self, "plain_greedy", self.greedy and self.num_logprobs is None and not processors)
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "has_logits_processors", processors)


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens', most likely first."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """A run of one request's prompt tokens scored: the first at ``first_position``, one entry per token."""

    request_id: int
    first_position: int
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class StepOutput:
    """One plan's tokens in result order and the time spent computing and sampling them."""

    token_ids: list[int] = field(default_factory=list)
    # Parallel to token_ids when any request asked for logprobs (None for those that did not); else empty.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    # Requests with num_prompt_logprobs whose prompt this step computed (part of).
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The decode passes a multi-step plan ran when it was cut short (``TableExecutor.cut``); None: all of them.
    num_passes: int | None = None
