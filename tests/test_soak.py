"""The soak: 10,000 requests over minutes against the real processes, random cancels, one executor restart.

Run with ``make soak``. It prints what a user and an operator would check: requests
completed, cancelled and failed, KV blocks leaked, and the scheduler's memory at
start and end. Every completed stream must be exact; no request may fail and no
block may leak.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from executor_svc.shadow import reference_generate
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service_fixtures import (
    Stack,
    assert_idle,
    executor_argv,
    free_port,
    running_stack,
    spawn,
    stop_process,
    token_request,
    wait_serving,
)

pytestmark = pytest.mark.soak

NUM_REQUESTS = 10_000
# About four minutes of arrivals.
ARRIVALS_PER_S = 40.0
MAX_IN_FLIGHT = 256
CANCEL_FRACTION = 0.1
RESTART_AT = NUM_REQUESTS // 2
REQUEST_TIMEOUT_S = 120.0
SOAK_TIMEOUT_S = 1500.0
SHADOW = dict(num_blocks=1024, block_size=4, vocab_size=50, max_model_len=1024, eos_token_ids=0)


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    failures: list[str] = field(default_factory=list)
    wrong: int = 0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def one_request(stub: pb_grpc.GenerationStub, rng: random.Random, tally: Tally) -> None:
    prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 100))]
    max_tokens = rng.randint(1, 400)
    cancel_after_s = rng.uniform(0, 0.3) if rng.random() < CANCEL_FRACTION else None
    request = token_request(prompt, max_tokens)
    request.sampling.temperature = 0
    call = stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
    reading = asyncio.ensure_future(read_all(call))
    if cancel_after_s is not None:
        done, _ = await asyncio.wait([reading], timeout=cancel_after_s)
        if not done:
            call.cancel()
            reading.cancel()
            tally.cancelled += 1
            return
    try:
        tokens = await reading
    except grpc.aio.AioRpcError as e:
        tally.failures.append(f"{e.code().name}: {e.details()}")
        return
    tally.completed += 1
    tally.wrong += tokens != reference_generate(prompt, max_tokens, 50, {0}, max_model_len=1024)


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[int]:
    tokens = []
    while (response := await call.read()) != grpc.aio.EOF:
        tokens.extend(response.token_ids)
    return tokens


async def drive(stack: Stack, restart: threading.Event) -> Tally:
    """Poisson arrivals at ARRIVALS_PER_S, at most MAX_IN_FLIGHT at once: minutes of steady, bursty traffic."""
    tally = Tally()
    rng = random.Random(2026)
    in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def bounded(stub: pb_grpc.GenerationStub) -> None:
        async with in_flight:
            await one_request(stub, rng, tally)

    async def issue(stub: pb_grpc.GenerationStub) -> None:
        tasks = []
        for i in range(NUM_REQUESTS):
            if i == RESTART_AT:
                restart.set()
            await asyncio.sleep(rng.expovariate(ARRIVALS_PER_S))
            tasks.append(asyncio.ensure_future(bounded(stub)))
        await asyncio.gather(*tasks)

    async with grpc.aio.insecure_channel(stack.target) as channel:
        await asyncio.wait_for(issue(pb_grpc.GenerationStub(channel)), SOAK_TIMEOUT_S)
    return tally


def test_soak_10k_requests_with_cancels_and_an_executor_restart(tmp_path: Path):
    port = free_port()
    restart = threading.Event()
    restarted = []
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port,
                       max_num_seqs=64, max_num_batched_tokens=1024) as s:

        def restart_executor() -> None:
            restart.wait()
            s.executor.kill()
            s.executor.wait()
            time.sleep(1.0)
            restarted.append(spawn(executor_argv("shadow", port, SHADOW), tmp_path / "executor-restarted.log"))
            wait_serving(s.target, s.scheduler)

        rss_start = rss_kib(s.scheduler.pid)
        restarter = threading.Thread(target=restart_executor, daemon=True)
        restarter.start()
        started = time.monotonic()
        try:
            tally = asyncio.run(drive(s, restart))
            restarter.join(60)
            stats = assert_idle(s.stub)
            rss_end = rss_kib(s.scheduler.pid)
            leaked = stats.num_blocks - stats.num_free_blocks
            print(
                f"\nsoak: {NUM_REQUESTS} requests in {time.monotonic() - started:.0f}s: "
                f"completed {tally.completed}, cancelled {tally.cancelled}, failed {len(tally.failures)}, "
                f"wrong tokens {tally.wrong}, blocks leaked {leaked}, executor restarts {len(restarted)}, "
                f"preemptions {stats.num_preemptions}, "
                f"scheduler RSS {rss_start / 1024:.1f} MiB -> {rss_end / 1024:.1f} MiB"
            )
            assert len(restarted) == 1
            assert not tally.failures, tally.failures[:5]
            assert tally.wrong == 0 and leaked == 0
            assert tally.completed + tally.cancelled == NUM_REQUESTS
            assert s.executor_reset() == 0, "the executor still held requests"
        finally:
            for process in restarted:
                stop_process(process)
