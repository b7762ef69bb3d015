"""The prefix cache's events (``core.kv_events``) as numbered batches, kept for a while and handed to subscribers.

The engine loop calls ``collect`` at the end of each iteration (one engine step): the events the block manager
recorded since become one batch with the next sequence number. The block manager records nothing until a subscriber
has it ``listen`` (on the loop thread), so a scheduler nobody listens to pays one attribute check per iteration.

Publishing never waits for a subscriber: each has a bounded backlog, and one that falls further behind loses its
oldest batches, which it sees as a gap in the sequence numbers. A subscriber that comes back names the sequence
number it wants next and gets the batches kept since (the last ``history`` of them), then the live ones.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.kv_events import BlockStored, KvEvent

# Batches kept for subscribers that resume (vLLM's buffer_steps default).
HISTORY_BATCHES = 10_000
# Batches one subscriber may fall behind before it loses the oldest.
BACKLOG_BATCHES = 1_024


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One iteration's events. Sequence numbers start at 1 and grow by one per batch; the events of a batch carry
    the ids ``first_event_id``, ``first_event_id + 1``, ... (ids grow across batches too)."""

    sequence_number: int
    # Wall-clock seconds (time.time) when it was collected.
    timestamp: float
    events: tuple[KvEvent, ...]
    first_event_id: int


class Subscription:
    """One subscriber's batches not read yet; ``wake`` is called (on the loop thread) whenever some arrive."""

    def __init__(self, wake: Callable[[], None], backlog: int = BACKLOG_BATCHES) -> None:
        self._batches: deque[KvEventBatch] = deque(maxlen=backlog)
        self._wake = wake

    def put(self, batches: list[KvEventBatch]) -> None:
        self._batches.extend(batches)
        self._wake()

    def take(self) -> list[KvEventBatch]:
        """Every batch that arrived since the last take, oldest first (any thread, one reader)."""
        taken = []
        while self._batches:
            taken.append(self._batches.popleft())
        return taken


class KvEventLog:
    """Numbers, keeps and fans out the prefix cache's events; ``collect`` on the loop thread, the rest anywhere."""

    def __init__(self, history: int = HISTORY_BATCHES) -> None:
        self._history: deque[KvEventBatch] = deque(maxlen=history)
        self._subscriptions: list[Subscription] = []
        self._lock = threading.Lock()
        self._sequence_numbers = itertools.count(1)
        self._next_event_id = 1

    def collect(self, block_manager: BlockManager, lora_name: Callable[[int], str]) -> None:
        """The loop thread, after each iteration: what the cache recorded becomes the next batch, each stored block
        of an adapter named (``lora_name`` of its id)."""
        if block_manager.events:
            events = block_manager.take_events()
            for event in events:
                if isinstance(event, BlockStored) and event.lora_id:
                    event.lora_name = lora_name(event.lora_id)
            self.publish(events)

    def publish(self, events: list[KvEvent]) -> None:
        with self._lock:
            batch = KvEventBatch(next(self._sequence_numbers), time.time(), tuple(events), self._next_event_id)
            self._next_event_id += len(events)
            self._history.append(batch)
            for subscription in self._subscriptions:
                subscription.put([batch])

    def subscribe(self, wake: Callable[[], None], start_sequence_number: int = 0,
                  backlog: int = BACKLOG_BATCHES) -> Subscription:
        """Batches from ``start_sequence_number`` on (those still kept), then each new one; 0: the new ones only.
        The caller has the block manager ``listen`` first."""
        subscription = Subscription(wake, backlog)
        with self._lock:
            if start_sequence_number > 0 and (kept := self._kept(start_sequence_number)):
                subscription.put(kept)
            self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscriptions.remove(subscription)

    def since(self, start_sequence_number: int) -> list[KvEventBatch]:
        """The batches still kept from ``start_sequence_number`` on (a ZMQ replay)."""
        with self._lock:
            return self._kept(start_sequence_number)

    def _kept(self, start_sequence_number: int) -> list[KvEventBatch]:
        return [batch for batch in self._history if batch.sequence_number >= start_sequence_number]
