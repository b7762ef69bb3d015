"""A request's outputs on their way to its reader, on an event loop: shared by the scheduler's own API and the API
process (``api.api_process``), which reads the same outputs from the link."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from scheduler_svc.core.outputs import RequestOutput


class Outbox:
    """A request's outputs on their way to its reader, handed over all at once (event-loop thread only).

    Lighter than an ``asyncio.Queue``: with it and ``codec.to_response``'s one-call message, the event loop spends
    less CPU per step of streamed tokens, most of the rest being gRPC's own sending (W5 ``api``). A reader that falls
    behind takes everything that arrived since its last read.
    """

    __slots__ = ("_outputs", "_waiter", "_interval", "_tokens", "_started", "_due")

    def __init__(self, stream_interval: int | None = 1) -> None:
        """``stream_interval``: tokens of one choice to gather before the reader gets them (``--stream-interval``);
        a choice's first output, and any output that ends a choice or the request, go at once. None, for a reader
        of whole completions (GenerateOnce, HTTP without ``stream``): only a choice's end or the request's failure
        wakes it, not every token of a step."""
        self._outputs: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._interval = stream_interval if stream_interval is not None else math.inf
        # Tokens gathered since the last take, by choice; an output without tokens counts as one.
        self._tokens: dict[int, int] = {}
        self._started: set[int] = set()  # the choices that were handed over before
        self._due = False

    @property
    def interval(self) -> float:
        """Tokens of one choice its reader takes at a time (inf: whole completions)."""
        return self._interval

    def put_nowait(self, output: RequestOutput) -> None:
        self._outputs.append(output)
        index = output.index
        tokens = self._tokens[index] = self._tokens.get(index, 0) + (len(output.token_ids) or 1)
        if not self._due:
            self._due = (tokens >= self._interval or (index not in self._started and self._interval != math.inf)
                         or output.finish_reason is not None or output.error is not None)
        if self._due and self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        """Every output since the last take, once they are due."""
        while not self._due:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        outputs, self._outputs = self._outputs, []
        self._started.update(self._tokens)
        self._tokens.clear()
        self._due = False
        return outputs


class ChoicesReader:
    """A request's outputs read from its ``Outbox`` until each of its ``remaining`` choices finished: the loop of
    the scheduler's ``frontend.Generation`` and of the API process's ``api_http.LinkGeneration``."""

    def __init__(self, outbox: Outbox, remaining: int) -> None:
        self.outbox = outbox
        self.remaining = remaining

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Everything produced since the last read, so a slow reader gets fewer, larger pieces; raises the
        request's failure (always its last output: nothing of a failed request follows it) once what came before it
        is read."""
        while self.remaining:
            self.give_way()
            outputs = await self.outbox.take()
            self.give_way()
            error = outputs[-1].error
            if error is not None:
                outputs.pop()
            if outputs:
                self.remaining -= sum(output.finish_reason is not None for output in outputs)
                yield outputs
            if error is not None:
                raise self.failure(error)

    def give_way(self) -> None:
        """Called around each wait for outputs."""

    def failure(self, error: Exception) -> Exception:
        """The exception ``batches`` raises for the request's failure."""
        return error
