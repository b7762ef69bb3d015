"""Admission: bounds on what waits to be scheduled, counted from submit until a request's first output.

RPC threads ``admit``; the loop thread ``release``s. A request past the bounds is refused at once
(QueueFull), so a burst costs callers a retry instead of unbounded memory and latency.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NoReturn

from scheduler_svc.core.errors import STOPPING, InvalidRequest, QueueFull, ServerStopping


@dataclass(frozen=True)
class QueueLimits:
    """Requests and prompt tokens waiting to be scheduled (not yet producing tokens) before submit refuses."""

    max_requests: int = 1024
    max_tokens: int = 1 << 20


class Admission:
    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.num_requests = 0
        self.num_tokens = 0
        self.closed = False

    def admit(self, num_prompt_tokens: int) -> None:
        """Count a request in, or raise InvalidRequest (it could never fit), ServerStopping or QueueFull."""
        limits = self.limits
        if num_prompt_tokens > limits.max_tokens:
            raise InvalidRequest("prompt", f"{num_prompt_tokens} tokens is more than this server queues at once "
                                           f"(--max-queued-tokens {limits.max_tokens})")
        with self._lock:
            if self.closed:
                raise ServerStopping(STOPPING)
            if self.num_requests >= limits.max_requests:
                raise QueueFull(f"{self.num_requests} requests are already waiting to be scheduled "
                                f"(--max-queued-requests {limits.max_requests}); retry later")
            if self.num_tokens + num_prompt_tokens > limits.max_tokens:
                raise QueueFull(f"{self.num_tokens} prompt tokens are already waiting to be scheduled and "
                                f"{num_prompt_tokens} more would pass --max-queued-tokens {limits.max_tokens}; "
                                "retry later")
            self.num_requests += 1
            self.num_tokens += num_prompt_tokens

    def release(self, num_prompt_tokens: int) -> None:
        """A request admitted earlier produces output or is done: it no longer counts."""
        with self._lock:
            self.num_requests -= 1
            self.num_tokens -= num_prompt_tokens

    def withdraw(self, num_prompt_tokens: int) -> NoReturn:
        """A request admitted as the server closed, too late to be queued: no longer counted, and refused."""
        self.release(num_prompt_tokens)
        raise ServerStopping(STOPPING)

    def close(self) -> None:
        """Refuse every later request (shutdown)."""
        with self._lock:
            self.closed = True
