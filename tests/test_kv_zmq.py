"""The prefix cache's events over ZMQ in vLLM's format, read the way llm-d's scorer and vLLM's own example read them:
a SUB socket, three frames (topic, 8-byte sequence number, msgpack batch), events as tagged arrays."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest
import zmq

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.api.kv_events_config import KvEventsConfig, parse_kv_events_config
from scheduler_svc.api.kv_zmq import END_OF_REPLAY, ZmqKvPublisher
from scheduler_svc.config import parse_config
from scheduler_svc.core.block_manager import NO_HASH, chain_hash
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_svc.engine.kv_events import KvEventLog
from tests.service_fixtures import assert_idle_async, free_port, in_process_scheduler, stream, token_request

RECEIVE_TIMEOUT_MS = 5000


def test_the_config_takes_vllms_json_and_names_what_is_wrong() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                    '"endpoint": "tcp://*:5557", "topic": "kv@pod@model", "buffer_steps": 5}')
    assert config == KvEventsConfig(endpoint="tcp://*:5557", topic="kv@pod@model", buffer_steps=5)
    assert not parse_kv_events_config('{"publisher": "null"}').publishes
    for text, named in [('{"endpont": "x"}', "endpont"), ('{"hwm": "many"}', "hwm"), ('{"hwm": 0}', "hwm"),
                        ('{"publisher": "kafka"}', "publisher"), ("[1]", "object"), ("{", "JSON")]:
        with pytest.raises(ValueError, match=named):
            parse_kv_events_config(text)
    with pytest.raises(SystemExit):
        parse_config(["--kv-events-config", '{"topic": 3}'], env={})


def subscriber(context: zmq.Context, address: str, bind: bool = False) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    (sub.bind if bind else sub.connect)(address)
    return sub


def first_received(sub: zmq.Socket, log: KvEventLog) -> list[bytes]:
    """Publish until a message gets through (a new subscription takes a moment to reach the publisher)."""
    deadline = time.monotonic() + RECEIVE_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        log.publish([AllBlocksCleared()])
        if sub.poll(50):
            return sub.recv_multipart()
    raise AssertionError("no KV event batch arrived over ZMQ")


def drain(sub: zmq.Socket) -> None:
    while sub.poll(100):
        sub.recv_multipart()


@pytest.mark.parametrize("publisher_binds", [True, False], ids=["publisher-binds", "router-binds"])
def test_batches_arrive_as_vllm_publishes_them_and_a_replay_resends_the_kept_ones(publisher_binds: bool,
                                                                                  tmp_path) -> None:
    port = free_port()
    endpoint = f"tcp://*:{port}" if publisher_binds else f"tcp://127.0.0.1:{port}"
    replay_endpoint = f"ipc://{tmp_path}/replay"
    context = zmq.Context()
    sub = subscriber(context, f"tcp://127.0.0.1:{port}", bind=not publisher_binds)
    publisher = ZmqKvPublisher(KvEventsConfig(endpoint=endpoint, topic="kv@pod@m", replay_endpoint=replay_endpoint))
    log = KvEventLog()
    publisher.start(log)
    try:
        topic, number, payload = first_received(sub, log)
        assert topic == b"kv@pod@m" and len(number) == 8
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        drain(sub)
        h1 = chain_hash([1, 2], NO_HASH)
        h2 = chain_hash([3, 4], h1)
        log.publish([BlockStored([h1, h2], None, [1, 2, 3, 4], 2), BlockRemoved([h1]),
                     BlockStored([h2], None, [3, 4], 2, lora_id=3, lora_name="a1")])
        topic, number, payload = sub.recv_multipart()
        timestamp, events = msgpack.unpackb(payload)
        assert abs(timestamp - time.time()) < 60
        # llm-d's reader's order: ..., block_size, lora_id, medium, lora_name (nil lora: the base model's blocks),
        # extra_keys (nil for a block with none)
        assert events == [["BlockStored", [h1, h2], None, [1, 2, 3, 4], 2, None, None, None, [None, None]],
                          ["BlockRemoved", [h1], None], ["BlockStored", [h2], None, [3, 4], 2, 3, None, "a1", [["a1"]]]]
        last = int.from_bytes(number, "big")
        replay = context.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
        replay.connect(replay_endpoint)
        replay.send_multipart((b"", (last - 1).to_bytes(8, "big")))
        replayed = []
        while (frames := replay.recv_multipart())[1] != END_OF_REPLAY:
            replayed.append(int.from_bytes(frames[1], "big"))
        assert replayed == [last - 1, last]
        replay.close()
    finally:
        publisher.close()
        sub.close()
        context.term()


def test_a_bad_endpoint_fails_at_start() -> None:
    with pytest.raises(OSError, match="cannot open"):
        ZmqKvPublisher(KvEventsConfig(endpoint="tcp://*:notaport"))


def test_a_served_prompt_is_published_with_the_cache_hashes() -> None:
    """A scheduler with ``--kv-events-config``: a prompt's full blocks are published as the prefix cache hashes them."""
    port = free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                         "topic": "kv"})
    prompt = list(range(1, 14))

    async def main() -> list[list]:
        context = zmq.Context()
        sub = subscriber(context, f"tcp://127.0.0.1:{port}")
        try:
            async with in_process_scheduler(ShadowExecutor(num_blocks=32, block_size=4, vocab_size=50),
                                            kv_events_config=config) as s:
                # The subscription reaches the publisher: a batch published into the engine's log gets through.
                await asyncio.to_thread(first_received, sub, s.server.loop.engine.kv_events)
                await asyncio.to_thread(drain, sub)
                await stream(s.stub, token_request(prompt, max_tokens=2))
                await assert_idle_async(s.stub)
                events = []
                while await asyncio.to_thread(sub.poll, 500):
                    events += msgpack.unpackb(sub.recv_multipart()[2])[1]
                return events
        finally:
            sub.close()
            context.term()

    stored = [event for event in asyncio.run(main()) if event[0] == "BlockStored"]
    h1 = chain_hash(prompt[:4], NO_HASH)
    h2 = chain_hash(prompt[4:8], h1)
    h3 = chain_hash(prompt[8:12], h2)
    assert stored[0][:5] == ["BlockStored", [h1, h2, h3], None, prompt[:12], 4]
