"""Many clients at once, a third of them walking away mid-stream: nothing leaks, the others are exact."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc

from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service_fixtures import assert_idle, collect, executor_argv, free_port, running_stack, token_request

# Fewer blocks than 64 running streams need at their longest, so preemption runs under the cancellations too.
SHADOW = dict(num_blocks=512, block_size=4, vocab_size=50, max_model_len=512, eos_token_ids=0)
NUM_CLIENTS = 200


async def client(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int,
                 cancel_after_s: float | None) -> list[pb.GenerateResponse] | None:
    """The whole stream, or None when this client cancels: ``cancel_after_s`` after its first response (so the
    server has its request, whatever the speed of the machine)."""
    call = stub.Generate(token_request(prompt, max_tokens, ignore_eos=True))
    if cancel_after_s is None:
        return [r async for r in call]
    await call.read()
    reading = asyncio.ensure_future(call.read())
    await asyncio.sleep(cancel_after_s)
    call.cancel()
    reading.cancel()
    return None


def test_200_clients_a_third_cancelling_at_random_times(tmp_path: Path):
    rng = random.Random(11)
    work = [([rng.randrange(1, 50) for _ in range(rng.randint(1, 40))], rng.randint(20, 200),
             rng.uniform(0, 0.15) if rng.random() < 1 / 3 else None) for _ in range(NUM_CLIENTS)]
    port = free_port()

    async def run(target: str) -> list[list[pb.GenerateResponse] | None]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await asyncio.gather(*(client(stub, *w) for w in work))

    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port,
                       max_num_seqs=64, max_num_batched_tokens=512) as s:
        results = asyncio.run(run(s.target))
        stats = assert_idle(s.stub)
        assert s.executor_reset() == 0, "the executor still held requests"
    completed = 0
    for (prompt, max_tokens, cancel_after_s), responses in zip(work, results, strict=True):
        if cancel_after_s is None:
            got = collect(responses)
            assert got.token_ids == reference_generate(prompt, max_tokens, 50, {0}, True, max_model_len=512)
            completed += 1
    assert completed >= NUM_CLIENTS // 2
    assert stats.num_aborted >= NUM_CLIENTS // 10, "too few clients cancelled before their stream ended"
    assert stats.num_preemptions > 0
