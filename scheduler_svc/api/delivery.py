"""How a step's outputs reach their readers: the engine loop's ``deliver``, on its thread, once a step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from scheduler_svc.api.api_link import ApiProcess, RemoteSink
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.engine.loop import RequestHandle
from scheduler_svc.engine.turn import Turn

Batch = list[tuple[RequestHandle, RequestOutput]]


def deliver_to_event_loop(aio_loop: asyncio.AbstractEventLoop, turn: Turn):
    """The engine loop's ``deliver``: one thread hop per step, then, once the engine's turn is over, each output into
    its caller's outbox."""

    def dispatch(batch: Batch) -> None:
        turn.give_way()
        for handle, output in batch:
            handle.sink.put_nowait(output)

    def deliver(batch: Batch) -> None:
        aio_loop.call_soon_threadsafe(dispatch, batch)

    return deliver


def link_deliver(dispatch_local: Callable[[Batch], None]):
    """The engine loop's ``deliver`` with an API process: its requests' outputs onto the link, one frame a step, the
    rest to ``dispatch_local`` (the HTTP API's and in-process callers')."""

    def deliver(batch: Batch) -> None:
        local: Batch = []
        links: dict[ApiProcess, list[tuple[int, RequestOutput]]] = {}
        for handle, output in batch:
            sink = handle.sink
            if type(sink) is RemoteSink:
                links.setdefault(sink.link, []).append((sink.key, output))
            else:
                local.append((handle, output))
        for link, items in links.items():
            link.send_outputs(items)
        if local:
            dispatch_local(local)

    return deliver
