"""A scheduler killed or drained mid-generation costs its clients nothing: two real stacks behind one client,
one scheduler killed with SIGKILL (or stopped with SIGTERM and no grace, so it ends its streams with ABORT and
the nanoserve-drained trailer) while it streams, and every stream finishes on the other with exactly the tokens
of an undisturbed run (GenerateRequest.resume, balanced by round_robin)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest

from client import AsyncClient, Client
from client.failover import channel_target
from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import Stack, executor_argv, free_port, running_stack
from tests.test_reliability_faults import SHADOW, assert_executor_clean, expected, workload

START_TIMEOUT_S = 60


def stop_a_busy_scheduler(stacks: list[Stack], how: str) -> Stack:
    victim = next(s for s in stacks if s.stub.GetStats(pb.GetStatsRequest(), timeout=5).num_running > 0)
    if how == "kill":
        victim.scheduler.kill()
    else:
        victim.scheduler.terminate()
    return victim


async def async_streams(stacks: list[Stack], work: list[tuple[list[int], int]], how: str) -> tuple[list, Stack]:
    """Start every stream, kill a scheduler that runs some once each has tokens, read them all."""
    started = [asyncio.Event() for _ in work]
    async with AsyncClient(servers=[s.target for s in stacks], timeout=120) as client:

        async def one(i: int, prompt: list[int], max_tokens: int) -> list[int]:
            tokens = []
            async for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
                tokens += chunk.token_ids
                started[i].set()
            return tokens

        tasks = [asyncio.create_task(one(i, p, m)) for i, (p, m) in enumerate(work)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=START_TIMEOUT_S)
        victim = stop_a_busy_scheduler(stacks, how)
        return await asyncio.gather(*tasks), victim


def sync_streams(stacks: list[Stack], work: list[tuple[list[int], int]], how: str) -> tuple[list, Stack]:
    """The same with the blocking client, one thread per stream."""
    started = [threading.Event() for _ in work]
    tokens: list[list[int]] = [[] for _ in work]
    with Client(servers=[s.target for s in stacks], timeout=120) as client:

        def one(i: int, prompt: list[int], max_tokens: int) -> None:
            for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
                tokens[i] += chunk.token_ids
                started[i].set()

        threads = [threading.Thread(target=one, args=(i, p, m)) for i, (p, m) in enumerate(work)]
        for thread in threads:
            thread.start()
        assert all(e.wait(START_TIMEOUT_S) for e in started)
        victim = stop_a_busy_scheduler(stacks, how)
        for thread in threads:
            thread.join()
    return tokens, victim


async def joined_completions(stacks: list[Stack], work: list[tuple[list[int], int]], how: str) -> tuple[list, Stack]:
    """Whole completions (``AsyncClient.generate``: one response per JOINED_STREAM_INTERVAL tokens), a busy scheduler
    stopped once 16 plans ran (of up to 8 decode steps each at default flags): past every stream's first few
    responses, far from their 400-600 tokens."""
    async with AsyncClient(servers=[s.target for s in stacks], timeout=120) as client:
        tasks = [asyncio.create_task(client.generate(token_ids=p, max_tokens=m, ignore_eos=True, temperature=0))
                 for p, m in work]
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while sum(s.stub.GetStats(pb.GetStatsRequest(), timeout=5).num_steps for s in stacks) < 16:
            assert asyncio.get_running_loop().time() < deadline, "the completions did not start"
            await asyncio.sleep(0.01)
        victim = stop_a_busy_scheduler(stacks, how)
        return [list(c.token_ids) for c in await asyncio.gather(*tasks)], victim


STREAMS = {"async": async_streams, "sync": sync_streams, "generate": joined_completions}


@pytest.mark.parametrize(("kind", "how"), [("async", "kill"), ("sync", "kill"), ("async", "drain"), ("sync", "drain"),
                                           ("generate", "kill")])
def test_a_scheduler_killed_mid_generation_costs_its_streams_nothing(tmp_path: Path, kind: str, how: str):
    work = workload(8, seed=5, min_tokens=400, max_tokens=600)
    with contextlib.ExitStack() as stack:
        stacks = []
        for name in ("a", "b"):
            port = free_port()
            stacks.append(stack.enter_context(running_stack(
                executor_argv("shadow", port, SHADOW), tmp_path / name, executor_port=port, shutdown_grace=0)))
        streams = STREAMS[kind]
        tokens, victim = streams(stacks, work, how) if kind == "sync" else asyncio.run(streams(stacks, work, how))
        assert victim.scheduler.wait(timeout=10) == (-9 if how == "kill" else 0)
        assert tokens == [expected(p, m, ignore_eos=True) for p, m in work]
        (survivor,) = [s for s in stacks if s is not victim]
        assert_executor_clean(survivor)
        finished = survivor.stub.GetStats(pb.GetStatsRequest(), timeout=5).num_finished_length
        assert finished == len(work), "not every stream ended on the survivor"


def test_several_servers_become_one_balanced_static_target():
    assert channel_target("127.0.0.1:1,localhost:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", True)
    assert channel_target("", ["[::1]:1", "::1:2"]) == ("ipv6:[::1]:1,[::1]:2", True)
    assert channel_target("dns:///sched.default.svc:50051") == ("dns:///sched.default.svc:50051", True)
    assert channel_target("127.0.0.1:50051") == ("127.0.0.1:50051", False)
    with pytest.raises(ValueError, match="IPv4 or all IPv6"):
        channel_target("127.0.0.1:1,[::1]:2")
