"""The prefix cache's events over ZMQ, as vLLM publishes them, for routers that read vLLM's (llm-d's scorer).

Each batch is one PUB message of three frames: the topic, the batch's sequence number (8 bytes, big-endian) and
the batch in msgpack: ``[timestamp, [event, ...]]``, each event an array led by its type's name:
``["BlockStored", hashes, parent_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]`` (``medium`` nil: the executor's own cache; ``lora_id``
and ``lora_name`` nil for the base model's blocks; ``extra_keys`` one entry a block, as vLLM's: the adapter's name and,
on a prompt's first block, the request's cache salt, nil where neither). Tagged arrays, as llm-d's event readers
decode them.
Hashes are the prefix cache's chained xxh64 (keyed by a secret of the process), unsigned 64-bit.

A thread of its own encodes and sends, so the engine loop never waits for ZMQ; it reads the batches from a
bounded subscription of ``KvEventLog``, so a publisher that falls behind drops the oldest (a gap in the numbers).
With ``replay_endpoint``, a ROUTER socket answers ``[start]`` (8 bytes) with ``[seq, payload]`` for every batch
kept from ``start`` on, then ``[-1, b""]``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import msgpack
import zmq

from scheduler_svc.api.kv_events_config import KvEventsConfig
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from scheduler_svc.engine.kv_events import KvEventBatch, KvEventLog, Subscription

log = logging.getLogger("nanoserve.scheduler")

# Ends a replay (vLLM's marker: -1 as a signed 8-byte integer).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread sleeps without news before it looks at the replay socket again.
POLL_S = 0.05


def extra_keys(event: BlockStored) -> list[list[str] | None]:
    """What each block's hash took in besides its tokens, untagged as vLLM publishes it (nil for a block with none)."""
    lora = [event.lora_name] if event.lora_name is not None else []
    salted_first = event.cache_salt is not None and event.parent_block_hash is None
    keys = [lora + [event.cache_salt] if i == 0 and salted_first else lora for i in range(len(event.block_hashes))]
    return [k or None for k in keys]


def event_fields(event: KvEvent) -> list[object]:
    """One event as vLLM's tagged array."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, None, event.lora_name, extra_keys(event)]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, None]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


def encode_batch(batch: KvEventBatch) -> bytes:
    return msgpack.packb([batch.timestamp, [event_fields(event) for event in batch.events]])


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard or local endpoint is bound (stable), any other connected to (volatile)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKvPublisher:
    """Publishes every batch of an engine's ``KvEventLog`` from ``start`` on until ``close``."""

    def __init__(self, config: KvEventsConfig) -> None:
        """Binds or connects at once, so a bad endpoint fails the start-up, before the executor answered."""
        self.config = config
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.linger = 0
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") from e
        self._topic = config.topic.encode()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._woken = threading.Event()
        self._stopped = threading.Event()
        self._events: KvEventLog | None = None
        self._subscription: Subscription | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)

    def start(self, events: KvEventLog) -> None:
        """Publish ``events``' batches from now on."""
        self._events = events
        self._subscription = events.subscribe(self._woken.set, backlog=self.config.max_queue_size)
        self._thread.start()
        log.info("publishing KV events on %s (topic %r)", self.config.endpoint, self.config.topic)

    def _run(self) -> None:
        """The only thread that touches the sockets once started."""
        while not self._stopped.is_set():
            self._woken.wait(POLL_S)
            self._woken.clear()
            for batch in self._subscription.take():
                payload = encode_batch(batch)
                number = batch.sequence_number.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, number, payload))
                self._sent.append((batch.sequence_number, payload))
            while self._replay is not None and self._replay.poll(0):
                self._answer_replay()
        self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], frames[-1]
        if len(start) != 8:
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
            return
        first = int.from_bytes(start, "big")
        for number, payload in list(self._sent):
            if number >= first:
                self._replay.send_multipart((client, b"", number.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close()
        self._context.term()

    def close(self) -> None:
        """Stop publishing; the sockets close on the publisher's thread (here, when it never started)."""
        if self._events is None:
            self._close_sockets()
            return
        self._events.unsubscribe(self._subscription)
        self._stopped.set()
        self._woken.set()
        self._thread.join(5)
