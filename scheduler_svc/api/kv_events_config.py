"""``--kv-events-config``: where the ZMQ publisher of the prefix cache's events sends them, in vLLM's JSON keys.

The same JSON a vLLM deployment passes to ``vllm serve --kv-events-config`` works here, so a router configured for
vLLM's events (llm-d's precise prefix-cache scorer) reads nanoserve's unchanged. Unlike vLLM, the flag itself asks
for events: ``enable_kv_cache_events`` and ``publisher`` default to on and "zmq".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KvEventsConfig:
    # False (or publisher "null"): no ZMQ publisher; SubscribeKvEvents serves the events either way.
    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    # A wildcard host (tcp://*:5557), ipc:// or inproc:// is bound; any other address is connected to (a router that
    # binds its own socket, as llm-d's does).
    endpoint: str = "tcp://*:5557"
    # A ROUTER socket bound here answers replay requests: 8 bytes, the first sequence number wanted (big-endian).
    replay_endpoint: str | None = None
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # ZMQ's send high-water mark: messages queued per peer before ZMQ drops them.
    hwm: int = 100_000
    # Batches waiting for the publisher thread before the oldest are dropped (a gap in sequence numbers).
    max_queue_size: int = 100_000
    # The first frame of every message; subscribers filter on its prefix (llm-d: kv@<pod>@<model>).
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """The flag's JSON as a config; ValueError naming the key at fault."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(given, dict):
        raise ValueError("expected a JSON object of vLLM's KV-events keys")
    known = {f.name: f for f in fields(KvEventsConfig)}
    for key, value in given.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r}; the keys are {', '.join(known)}")
        expected = {"bool": bool, "int": int}.get(str(known[key].type), str)
        nullable = key == "replay_endpoint" and value is None
        if not nullable and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            raise ValueError(f"{key}: expected {expected.__name__}, got {json.dumps(value)}")
        if expected is int and value < 1:
            raise ValueError(f"{key}: must be at least 1, got {value}")
    if given.get("publisher", "zmq") not in PUBLISHERS:
        raise ValueError(f"publisher: one of {', '.join(PUBLISHERS)}, got {given['publisher']!r}")
    return KvEventsConfig(**given)


def kv_events_flag(text: str) -> str:
    """The flag's type: the JSON as given once it parses (empty: no ZMQ publisher), so a bad one fails the start-up."""
    if text:
        try:
            parse_kv_events_config(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return text
