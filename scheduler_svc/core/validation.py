"""Every check a caller can trigger, in one place: what can never run is refused before it is queued.

Both entries use it: the public API (``api.prepare.prepare``, field names as in GenerateRequest) and
the in-process ``Engine.add_request``. Past this point the engine assumes a request is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling import DEFAULTS
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import max_kv_blocks


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


def completion_budget(requested: int | None, num_prompt_tokens: int, limits: ModelLimits) -> int:
    """``requested`` max_tokens, or the default capped to the room the prompt leaves."""
    room = limits.max_model_len - num_prompt_tokens
    if requested is None:
        return min(DEFAULTS["max_tokens"], room)
    if requested < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {requested}")
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
    bad = next((t for t in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")


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
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else limits.eos_token_ids)
    for i, t in enumerate(completion):
        if not 0 <= t < vocab:
            raise InvalidRequest(field, f"token id {t} at position {i} is outside the vocabulary [0, {vocab})")
        if t in stops and i + 1 >= params.min_tokens:  # before min_tokens a stop token does not stop
            raise InvalidRequest(field, f"token id {t} at position {i} is an EOS or stop token, which would have "
                                        "ended the generation there")


def check_fits_cache(num_prompt_tokens: int, params: SamplingParams, limits: ModelLimits) -> None:
    """Refuse a request that could not fit in the whole KV cache even alone."""
    needed = max_kv_blocks(num_prompt_tokens, params.max_tokens, limits.max_model_len, limits.block_size)
    if needed > limits.num_blocks:
        raise InvalidRequest("max_tokens", f"sequence needs {needed} KV blocks at its longest but the cache has "
                                           f"{limits.num_blocks}; shorten the prompt or max_tokens")


def check_request(token_ids: list[int], params: SamplingParams, limits: ModelLimits) -> None:
    """For a caller that built ``params`` itself (the in-process API), whose max_tokens may pass the model's
    length: such a request ends there with LENGTH, as vLLM's offline engine does."""
    check_prompt(token_ids, limits)
    check_token_ids(params, limits)
    check_fits_cache(len(token_ids), params, limits)
