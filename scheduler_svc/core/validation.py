"""Every check of a request's values, in one place: what can never run is refused before it is queued.

Both entries use it: the public APIs (``api.prepare`` for a GenerateRequest, whose field names its refusals then
carry; the OpenAI routes reach it through the same GenerateRequests) and the in-process ``Engine.add_request``.
The API layers check only their message's form (which fields go together); each maps ``InvalidRequest`` to its
status in one table. Past this point the engine assumes a request is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.sampling import (
    DEFAULTS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PATTERN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from scheduler_svc.core.bad_words import check_bad_words, first_banned
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import FinishReason, max_kv_blocks
from scheduler_svc.core.stop_rules import StopRule


@dataclass(frozen=True)
class ModelLimits:
    """What the executor's handshake says about the room a request has."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    # Which tokens a resumed completion cannot hold (they would have ended it).
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, info: object) -> ModelLimits:
        """From an ExecutorInfo (or anything with its fields)."""
        return cls(info.vocab_size, info.max_model_len, info.num_blocks, info.block_size,
                   frozenset(info.eos_token_ids))


def check_prompt(token_ids: list[int], limits: ModelLimits, field: str = "token_ids") -> None:
    if not token_ids:
        raise InvalidRequest(field, "the prompt is empty")
    vocab = limits.vocab_size
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {token_ids[bad]} at position {bad} is outside the vocabulary "
                                    f"[0, {vocab})")
    room = limits.max_model_len - len(token_ids)
    if room < 1:
        raise InvalidRequest("prompt", f"the prompt has {len(token_ids)} tokens, which leaves no room to generate "
                                       f"within the model's maximum length of {limits.max_model_len} tokens")


def completion_budget(requested: int | None, num_prompt_tokens: int, limits: ModelLimits,
                      to_room: bool = False, model_default: int | None = None, cap: bool = False) -> int:
    """``requested`` max_tokens, or the default capped to the room the prompt leaves; ``to_room``: that room, also
    bounded by the KV cache (vLLM's chat completions without max_tokens). ``model_default``: the model's own
    (generation_config.json's max_new_tokens), which replaces the default and caps that room, as vLLM's does.
    ``cap``: a ``requested`` beyond the room is the room (vLLM's Responses API), not a refusal."""
    room = limits.max_model_len - num_prompt_tokens
    if requested is None:
        if to_room:  # the last token sampled needs no KV slot (``max_kv_blocks``)
            budget = max(1, min(room, limits.num_blocks * limits.block_size + 1 - num_prompt_tokens))
            return budget if model_default is None else min(budget, model_default)
        return min(DEFAULTS["max_tokens"] if model_default is None else model_default, room)
    if requested < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {requested}")
    if requested > room and cap and room >= 1:
        return room
    if requested > room:
        raise InvalidRequest(
            "max_tokens",
            f"prompt of {num_prompt_tokens} tokens + max_tokens {requested} = {num_prompt_tokens + requested} "
            f"exceeds the model's maximum length of {limits.max_model_len} tokens",
        )
    return requested


def check_token_ids(params: SamplingParams, limits: ModelLimits) -> None:
    """Token ids inside the parameters name tokens of this model's vocabulary."""
    vocab = limits.vocab_size
    bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.allowed_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("allowed_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for word in params.bad_words_token_ids for t in word if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("bad_words", f"a word tokenizes to id {bad}, outside the model's vocabulary [0, {vocab})")
    bad = next((t for t in params.logprob_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("logprob_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.thinking_markers or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest("thinking_token_budget", f"the thinking's marker {bad} is outside the vocabulary "
                                                      f"[0, {vocab})")


def check_resume(completion: list[int], params: SamplingParams, limits: ModelLimits,
                 field: str = "resume.completion_token_ids") -> None:
    """A resumed completion must be one this request could have produced and not yet ended: a token that
    would have stopped it, or max_tokens reached, means there is nothing left to resume."""
    if not completion:
        return
    if params.n > 1:
        raise InvalidRequest(field, f"a generation of n = {params.n} choices cannot be resumed; resume needs n = 1")
    if len(completion) >= params.max_tokens:
        raise InvalidRequest(field, f"{len(completion)} tokens resumed but max_tokens is {params.max_tokens}: "
                                    "the generation was already complete")
    vocab = limits.vocab_size
    bad = next((i for i, t in enumerate(completion) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {completion[bad]} at position {bad} is outside the vocabulary "
                                    f"[0, {vocab})")
    # The prompt's length does not matter here: the model's length is the prompt's check.
    kept, reason = StopRule.of(params, 0, limits.eos_token_ids, limits.max_model_len).check(completion, 0)
    if reason is FinishReason.STOP:
        raise InvalidRequest(field, f"token id {completion[kept - 1]} at position {kept - 1} is an EOS or stop "
                                    "token, which would have ended the generation there")
    if reason is FinishReason.REPETITION:
        raise InvalidRequest(field, f"the tokens up to position {kept - 1} repeat a pattern, which would have ended "
                                    "the generation there")
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        bad = next((i for i, t in enumerate(completion) if t not in allowed), None)
        if bad is not None:
            raise InvalidRequest(field, f"token id {completion[bad]} at position {bad} is not among "
                                        "allowed_token_ids, so it could not have been sampled")
    bad = first_banned(completion, params.bad_words_token_ids)
    if bad is not None:
        raise InvalidRequest(field, f"token id {completion[bad]} at position {bad} completes a bad word, so it "
                                    "could not have been sampled")


def check_at_least_one(field: str, value: int | None) -> None:
    """An optional count that, when set, must be >= 1 (truncate_prompt_tokens, stream_interval)."""
    if value is not None and value < 1:
        raise InvalidRequest(field, f"must be >= 1, got {value}")


# vLLM's limits on a cache salt: its length, and characters a KV store's keys could split on.
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: str) -> None:
    """A salt ("": none) must be short enough to key a cache and hold no separator a KV store could split on."""
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise InvalidRequest("cache_salt", f"must be at most {MAX_CACHE_SALT_CHARS} characters and hold none of "
                                           "'@', '/', '\\' or NUL")


def check_fits_cache(num_prompt_tokens: int, params: SamplingParams, limits: ModelLimits) -> None:
    """Refuse a request that could not fit in the whole KV cache even alone."""
    needed = max_kv_blocks(num_prompt_tokens, params.max_tokens, limits.max_model_len, limits.block_size)
    if needed > limits.num_blocks:
        raise InvalidRequest("max_tokens", f"sequence needs {needed} KV blocks at its longest but the cache has "
                                           f"{limits.num_blocks}; shorten the prompt or max_tokens")


def check_request(token_ids: list[int], params: SamplingParams, limits: ModelLimits) -> None:
    """For a caller that built ``params`` itself (the in-process API), whose max_tokens may pass the model's
    length: such a request ends there with LENGTH, as vLLM's offline engine does."""
    check_sampling(params)
    check_prompt(token_ids, limits)
    check_token_ids(params, limits)
    check_fits_cache(len(token_ids), params, limits)


def check_sampling(params: SamplingParams) -> None:
    """The ranges of ``common.sampling``; raise InvalidRequest naming the first field out of range."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequest("temperature", f"must be a finite number >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {params.top_k}")
    if not (0 < params.top_p <= 1):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {params.top_p}")
    if not (0 <= params.min_p <= 1):
        raise InvalidRequest("min_p", f"must be in [0, 1], got {params.min_p}")
    if params.seed is not None and not (0 <= params.seed < 2**64):
        raise InvalidRequest("seed", f"must be in [0, 2**64), got {params.seed}")
    if (repetition := params.repetition_detection) is not None and not (
            1 <= repetition[0] <= repetition[1] <= MAX_REPETITION_PATTERN and repetition[2] >= 2):
        raise InvalidRequest("repetition_detection", f"needs 1 <= min_pattern_size <= max_pattern_size <= "
                                                     f"{MAX_REPETITION_PATTERN} and min_count >= 2 (a pattern seen "
                                                     f"twice at least), got {repetition}")
    named = len(params.logprob_token_ids)
    if named > MAX_LOGPROB_TOKEN_IDS:
        raise InvalidRequest("logprob_token_ids", f"at most {MAX_LOGPROB_TOKEN_IDS} token ids, got {named}")
    if named and params.logprobs not in (None, named):
        raise InvalidRequest("logprob_token_ids", f"logprobs must be unset or equal their number ({named}), got "
                                                  f"{params.logprobs}")
    for name in ("logprobs", "prompt_logprobs")[1 if named else 0:]:
        value = getattr(params, name)
        if value is not None and not (0 <= value <= MAX_LOGPROBS):
            raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    if params.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {params.max_tokens}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    if any(not s for s in params.stop):
        raise InvalidRequest("stop", "stop strings must not be empty")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} distinct stop token ids, "
                                               f"got {len(params.stop_token_ids)}")
    if any(t < 0 for t in params.stop_token_ids):
        raise InvalidRequest("stop_token_ids", "token ids must be >= 0")
    if not math.isfinite(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise InvalidRequest("repetition_penalty", f"must be a finite number > 0, got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    bad = next(((t, b) for t, b in params.logit_bias.items() if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"the bias of token {bad[0]} must be in [-{MAX_LOGIT_BIAS:g}, "
                                           f"{MAX_LOGIT_BIAS:g}], got {bad[1]}")
    if not 1 <= params.n <= MAX_N:
        raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {params.n}")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest("min_tokens", f"must be at most max_tokens ({params.max_tokens}), got {params.min_tokens}")
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise InvalidRequest("allowed_token_ids", "when given, it must hold at least one token id")
    check_bad_words(params.bad_words_token_ids)
    budget = params.thinking_token_budget
    if budget is not None and (budget < 0 or params.thinking_markers is None):
        raise InvalidRequest("thinking_token_budget", f"must be >= 0, got {budget}" if budget < 0 else
                             "needs the thinking's start and end token ids (the scheduler's --reasoning-parser)")
