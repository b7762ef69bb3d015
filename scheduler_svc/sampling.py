"""Per-request sampling and stopping parameters, and the one table of their defaults.

``DEFAULTS`` is what an unset field of a GenerateRequest means; the proto comments, the
CLI help and docs/client.md are tested against it (tests/test_defaults.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler_svc.errors import InvalidRequest

MAX_LOGPROBS = 20
# Every generated token is checked against every stop string: bound that work per request, as TGI does.
MAX_STOP_STRINGS = 16
# Stop token ids are a set looked up once per token; the bound keeps a request's plan-side state small.
MAX_STOP_TOKEN_IDS = 64

# Field -> default. max_tokens is further capped by the room the prompt leaves in the model's length.
DEFAULTS: dict[str, object] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "seed": None,
    "logprobs": None,
    "max_tokens": 256,
    "ignore_eos": False,
    "stop": (),
    "stop_token_ids": (),
}


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
    # An llguidance grammar (its JSON form) the completion follows, compiled and checked by ``structured``.
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.validate()

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
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
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
