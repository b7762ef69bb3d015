"""Per-request sampling and stopping parameters, validated where they enter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Every generated token is checked against every stop string: bound that work per request, as TGI does.
MAX_STOP_STRINGS = 16


class InvalidRequest(ValueError):
    """A request the engine refuses; ``field`` names what the caller must fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class SamplingParams:
    """What to sample and when to stop. Defaults match vLLM's ``SamplingParams``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int = 256
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
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
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "token ids must be >= 0")
