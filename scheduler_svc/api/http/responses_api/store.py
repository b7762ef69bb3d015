"""The responses a server keeps (``store``: true, OpenAI's default), for ``previous_response_id``, retrieval and
background mode: the last ``capacity`` of them, in memory, in the process that answered them. vLLM keeps every
one without bound where VLLM_ENABLE_RESPONSES_API_STORE is set, none otherwise; --responses-store 0 keeps none.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.responses_api.schemas import ResponseObject

# Statuses a background response can still leave.
UNFINISHED = ("queued", "in_progress")


@dataclass
class Stored:
    """One kept response, the conversation it answered, and, for a background one, its work and streamed events."""

    response: ResponseObject
    messages: list[dict[str, Any]]
    task: asyncio.Task | None = None
    # A background stream's events so far (server-sent, numbered from 0); None for any other response.
    events: list[str] | None = None
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, response: ResponseObject) -> None:
        """The final response, unless it was cancelled first."""
        if self.response.status != "cancelled":
            self.response = response

    def add(self, event: str) -> None:
        assert self.events is not None
        self.events.append(event)
        self.wake()

    def end(self) -> None:
        self.ended = True
        self.wake()

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def replay(self, starting_after: int | None) -> AsyncIterator[str]:
        """A background stream's events after number ``starting_after`` (all of them for None), then the rest as they
        come, until it ends."""
        assert self.events is not None
        i = 0 if starting_after is None else max(starting_after + 1, 0)
        while True:
            changed = self.changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await changed.wait()


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, entry: Stored) -> None:
        """Keep ``entry``; past capacity the oldest finished ones go (a background one still working stays)."""
        self.entries[entry.response.id] = entry
        for key in list(self.entries)[:-1]:
            if len(self.entries) <= self.capacity:
                break
            if self.entries[key].response.status not in UNFINISHED:
                del self.entries[key]

    def get(self, response_id: str, param: str) -> Stored:
        entry = self.entries.get(response_id)
        if entry is None:
            kept = "" if self.enabled else " (this server keeps no responses: start it with --responses-store N)"
            raise ApiError(404, f"{param}: Response with id '{response_id}' not found.{kept}", param)
        return entry
