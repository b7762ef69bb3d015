"""The soak: 10,000 requests over minutes against two real stacks, random cancels, one executor restart and
two scheduler kills.

Run with ``make soak`` (``SOAK_REQUESTS=N`` for a shorter run). One client balances both schedulers
(round_robin) and resumes the streams of a killed one on the other (``GenerateRequest.resume``). It
prints what a user and an operator would check: requests completed, cancelled and failed, KV blocks
leaked, and the memory of the scheduler never killed at start and end. Every completed stream must be exact; no request
may fail and no block may leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from client import AsyncClient, NanoserveError
from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service_fixtures import (
    Stack,
    assert_idle,
    executor_argv,
    free_port,
    running_stack,
    scheduler_argv,
    spawn,
    stop_process,
    wait_serving,
)

pytestmark = pytest.mark.soak

NUM_REQUESTS = int(os.environ.get("SOAK_REQUESTS", 10_000))
# About four minutes of arrivals.
ARRIVALS_PER_S = 40.0
MAX_IN_FLIGHT = 256
CANCEL_FRACTION = 0.1
# Faults, by the request about to be sent: stack 1's scheduler is killed twice (it comes back on its port after
# SCHEDULER_DOWN_S), stack 0's executor is restarted between; stack 0's scheduler lives through it all.
FAULTS = {
    NUM_REQUESTS // 4: ("scheduler", 1),
    NUM_REQUESTS // 2: ("executor", 0),
    3 * NUM_REQUESTS // 4: ("scheduler", 1),
}
SCHEDULER_DOWN_S = 2.0
REQUEST_TIMEOUT_S = 120.0
SOAK_TIMEOUT_S = 1500.0
SHADOW = dict(num_blocks=1024, block_size=4, vocab_size=50, max_model_len=1024, eos_token_ids=0)
SCHEDULER_FLAGS = dict(max_num_seqs=64, max_num_batched_tokens=1024)


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    failures: list[str] = field(default_factory=list)
    wrong: int = 0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def one_request(client: AsyncClient, rng: random.Random, tally: Tally) -> None:
    prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 100))]
    max_tokens = rng.randint(1, 400)
    cancel_after_s = rng.uniform(0, 0.3) if rng.random() < CANCEL_FRACTION else None
    reading = asyncio.ensure_future(read_all(client, prompt, max_tokens))
    if cancel_after_s is not None:
        done, _ = await asyncio.wait([reading], timeout=cancel_after_s)
        if not done:
            reading.cancel()
            tally.cancelled += 1
            return
    try:
        tokens = await reading
    except NanoserveError as e:
        tally.failures.append(str(e))
        return
    tally.completed += 1
    tally.wrong += tokens != reference_generate(prompt, max_tokens, 50, {0}, max_model_len=1024)


async def read_all(client: AsyncClient, prompt: list[int], max_tokens: int) -> list[int]:
    return [t async for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, temperature=0)
            for t in chunk.token_ids]


async def drive(stacks: list[Stack], fault: list[threading.Event]) -> Tally:
    """Poisson arrivals at ARRIVALS_PER_S, at most MAX_IN_FLIGHT at once: minutes of steady, bursty traffic."""
    tally = Tally()
    rng = random.Random(2026)
    in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
    faults = dict(zip(FAULTS, fault, strict=True))

    async def bounded(client: AsyncClient) -> None:
        async with in_flight:
            await one_request(client, rng, tally)

    async def issue(client: AsyncClient) -> None:
        tasks = []
        for i in range(NUM_REQUESTS):
            if i in faults:
                faults[i].set()
            await asyncio.sleep(rng.expovariate(ARRIVALS_PER_S))
            tasks.append(asyncio.ensure_future(bounded(client)))
        await asyncio.gather(*tasks)

    async with AsyncClient(servers=[s.target for s in stacks], timeout=REQUEST_TIMEOUT_S) as client:
        await asyncio.wait_for(issue(client), SOAK_TIMEOUT_S)
    return tally


class Faults:
    """Runs FAULTS in a thread as the traffic reaches each; keeps what it started, to stop it at the end."""

    def __init__(self, stacks: list[Stack], tmp_path: Path) -> None:
        self.stacks, self.tmp_path = stacks, tmp_path
        self.events = [threading.Event() for _ in FAULTS]
        self.started: list[subprocess.Popen] = []
        self.done = {"executor": 0, "scheduler": 0}
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        for event, (kind, i) in zip(self.events, FAULTS.values(), strict=True):
            event.wait()
            s = self.stacks[i]
            victim = s.executor if kind == "executor" else s.scheduler
            victim.kill()
            victim.wait()
            time.sleep(1.0 if kind == "executor" else SCHEDULER_DOWN_S)
            log = self.tmp_path / f"{kind}-{i}-restarted-{self.done[kind]}.log"
            if kind == "executor":
                port = int(s.executor_target.rsplit(":", 1)[1])
                self.started.append(spawn(executor_argv("shadow", port, SHADOW), log))
            else:
                port = int(s.target.rsplit(":", 1)[1])
                s.scheduler = spawn(scheduler_argv(port, s.executor_target, **SCHEDULER_FLAGS), log)
                self.started.append(s.scheduler)
            wait_serving(s.target, s.scheduler)
            self.done[kind] += 1


def idle_stats(target: str):
    """On a new channel: the old one may still be backing off from the scheduler that was killed."""
    with grpc.insecure_channel(target) as channel:
        return assert_idle(pb_grpc.GenerationStub(channel))


def test_soak_10k_requests_with_cancels_an_executor_restart_and_scheduler_kills(tmp_path: Path):
    with contextlib.ExitStack() as exit_stack:
        stacks = []
        for name in ("a", "b"):
            port = free_port()
            stacks.append(exit_stack.enter_context(running_stack(
                executor_argv("shadow", port, SHADOW), tmp_path / name, executor_port=port, **SCHEDULER_FLAGS)))
        faults = Faults(stacks, tmp_path)
        exit_stack.callback(lambda: [stop_process(p) for p in faults.started])
        rss_start = rss_kib(stacks[0].scheduler.pid)
        faults.thread.start()
        started = time.monotonic()
        tally = asyncio.run(drive(stacks, faults.events))
        faults.thread.join(60)
        stats = [idle_stats(s.target) for s in stacks]
        rss_end = rss_kib(stacks[0].scheduler.pid)
        leaked = sum(st.num_blocks - st.num_free_blocks for st in stats)
        print(
            f"\nsoak: {NUM_REQUESTS} requests in {time.monotonic() - started:.0f}s: "
            f"completed {tally.completed}, cancelled {tally.cancelled}, failed {len(tally.failures)}, "
            f"wrong tokens {tally.wrong}, blocks leaked {leaked}, executor restarts {faults.done['executor']}, "
            f"scheduler kills {faults.done['scheduler']}, preemptions {sum(st.num_preemptions for st in stats)}, "
            f"surviving scheduler RSS {rss_start / 1024:.1f} MiB -> {rss_end / 1024:.1f} MiB"
        )
        assert faults.done == {"executor": 1, "scheduler": 2}
        assert not tally.failures, tally.failures[:5]
        assert tally.wrong == 0 and leaked == 0
        assert tally.completed + tally.cancelled == NUM_REQUESTS
        assert all(s.executor_reset() == 0 for s in stacks), "an executor still held requests"
