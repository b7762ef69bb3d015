"""Per-request sampling and stopping parameters, with the defaults and limits of ``common.sampling``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import xxhash

from common.sampling import (
    DEFAULTS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from common.step import SamplingSettings
from scheduler_svc.core.errors import InvalidRequest


@dataclass
class SamplingParams:
    """What to sample and when to stop; checked on construction (``validate``)."""

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    seed: int | None = DEFAULTS["seed"]
    logprobs: int | None = DEFAULTS["logprobs"]
    max_tokens: int = DEFAULTS["max_tokens"]
    ignore_eos: bool = DEFAULTS["ignore_eos"]
    stop: list[str] = field(default_factory=list)
    # A frozenset: looked up for every sampled token on the loop thread.
    stop_token_ids: frozenset[int] = frozenset()
    repetition_penalty: float = DEFAULTS["repetition_penalty"]
    presence_penalty: float = DEFAULTS["presence_penalty"]
    frequency_penalty: float = DEFAULTS["frequency_penalty"]
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = DEFAULTS["n"]
    min_tokens: int = DEFAULTS["min_tokens"]
    include_stop_str_in_output: bool = DEFAULTS["include_stop_str_in_output"]
    skip_special_tokens: bool = DEFAULTS["skip_special_tokens"]
    # Logprobs of the prompt's tokens with this many alternatives; such a prompt skips the prefix cache.
    prompt_logprobs: int | None = DEFAULTS["prompt_logprobs"]
    # An llguidance grammar (its JSON form) the completion follows, compiled and checked by ``structured``.
    grammar: str | None = None
    # What the executor's sampler needs of these, made once: every plan that sends the request whole carries it.
    settings: SamplingSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.validate()
        self.settings = SamplingSettings(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
            num_logprobs=self.logprobs, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=tuple(sorted(self.logit_bias.items())), min_tokens=self.min_tokens,
            # The min_tokens mask is all the executor does with these.
            stop_token_ids=tuple(sorted(self.stop_token_ids)) if self.min_tokens else (),
            ignore_eos=self.ignore_eos if self.min_tokens else False,
            grammar=self.grammar, num_prompt_logprobs=self.prompt_logprobs,
        )

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of n: the same settings and its own seed, derived from the request's seed and
        the index, so a seeded request is reproducible choice by choice (choice 0 keeps the seed itself). Only
        choice 0 scores the prompt, so the others can share its KV through the prefix cache."""
        if index == 0:
            return self
        seed = None if self.seed is None else xxhash.xxh64_intdigest(index.to_bytes(8, "little"), self.seed)
        return replace(self, seed=seed, n=1, prompt_logprobs=None)

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidRequest("seed", f"must be in [0, 2**64), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} distinct stop token ids, "
                                                   f"got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "token ids must be >= 0")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequest(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        bad = next(((t, b) for t, b in self.logit_bias.items() if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
        if bad is not None:
            raise InvalidRequest("logit_bias", f"the bias of token {bad[0]} must be in [-{MAX_LOGIT_BIAS:g}, "
                                               f"{MAX_LOGIT_BIAS:g}], got {bad[1]}")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
