"""Per-request sampling and stopping parameters, with the defaults and limits of ``common.sampling``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import xxhash

from common.sampling import DEFAULTS
from common.step import SamplingSettings


@dataclass
class SamplingParams:
    """What to sample and when to stop; ``validation.check_sampling`` checks the ranges where a request enters."""

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
    # Under a reasoning parser the grammar waits for the thinking's end (``api.thinking``): the completion's first
    # token among these (``</think>``), the grammar then following the tokens after it.
    grammar_after_token_ids: tuple[int, ...] = ()
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any. Given, it must hold one at least.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as the token-id sequences its rule bans (``bad_words.bad_words_token_ids`` makes them).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's thinking_token_budget: the most tokens after the start marker before the end marker is forced (None: no
    # budget); the markers are the reasoning parser's (``api.thinking``), set where the request is prepared.
    thinking_token_budget: int | None = None
    thinking_markers: tuple[int, int] | None = None
    # vLLM's logprob_token_ids: the alternatives each token's logprobs list, in this order (repeats once); logprobs is
    # their number as given, as vLLM counts it.
    logprob_token_ids: tuple[int, ...] = ()
    # vLLM's repetition_detection as (min_pattern_size, max_pattern_size, min_count): the completion ends once its
    # last tokens repeat a pattern; None: not asked.
    repetition_detection: tuple[int, int, int] | None = None
    # What the executor's sampler needs of these, made once: every plan that sends the request whole carries it.
    settings: SamplingSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.logprob_token_ids and self.logprobs is None:
            self.logprobs = len(self.logprob_token_ids)
        named = tuple(dict.fromkeys(self.logprob_token_ids))
        self.settings = SamplingSettings(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
            num_logprobs=len(named) if named else self.logprobs, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=tuple(sorted(self.logit_bias.items())), min_tokens=self.min_tokens,
            # The min_tokens mask is all the executor does with these.
            stop_token_ids=tuple(sorted(self.stop_token_ids)) if self.min_tokens else (),
            ignore_eos=self.ignore_eos if self.min_tokens else False,
            grammar=self.grammar, num_prompt_logprobs=self.prompt_logprobs,
            grammar_after_token_ids=self.grammar_after_token_ids,
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            bad_words_token_ids=tuple(map(tuple, self.bad_words_token_ids)),
            thinking_token_budget=self.thinking_token_budget if self.thinking_markers else None,
            thinking_start_token_id=self.thinking_markers[0] if self.thinking_markers else None,
            thinking_end_token_id=self.thinking_markers[1] if self.thinking_markers else None,
            logprob_token_ids=named,
        )

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of n: the same settings and its own seed, derived from the request's seed and
        the index, so a seeded request is reproducible choice by choice (choice 0 keeps the seed itself). Only
        choice 0 scores the prompt, so the others can share its KV through the prefix cache."""
        if index == 0:
            return self
        seed = None if self.seed is None else xxhash.xxh64_intdigest(index.to_bytes(8, "little"), self.seed)
        return replace(self, seed=seed, n=1, prompt_logprobs=None)
