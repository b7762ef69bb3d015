"""W5's ``api`` peer: the split as a deployment runs it, with the public API in front.

The scheduler service runs as a child process at its default flags, in front of its own simulated executor, and
``batch`` clients stream from it through ``client.api.AsyncClient`` in this process, one sequence each (``api_http``:
through ``/v1/completions``, each on a plain socket that parses only the token ids of each event). The
scheduler counts the decode passes (``GetStats.num_generation_tokens`` over the batch: a multi-step plan makes
several) between the moment every stream has ``warmup`` tokens and the moment every stream has ``warmup + steps``.
Its CPU time over the same window, every thread of it (the
engine loop, the streams, gRPC's own), is read from /proc; the clients' from this thread. The other peers
drive the Engine directly, so this one adds what serving the streams costs the scheduler's process: a GPU waits
for it exactly as it waits for the Engine. ``api_remote``'s clients run in a process of their own in SCHED_IDLE,
taking only the CPU the server leaves, as clients on other machines take none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc

from bench.common import HOST, Child, free_port, percentile
from client.api import AsyncClient
from common.cpu_yield import thread_ids, yield_cpu

# Every stream asks for this many times --steps tokens past the timed window: a stream that is read late (the
# clients share the CPU) still has the whole batch decoding beside it until the window ends; it is cancelled then.
# At 1, one run in seven of 256 streams at 2 ms (the scheduler's process saturated) failed: one stream had read its
# 420 tokens while 43 had not read 220, the slowest 76.
TAIL_FACTOR = 4
# The floor has no KV cache to size, and it starts stepping the first stream at once, while the last one may open
# a hundred steps later (256 streams, 2 ms): its streams ask for far more.
FLOOR_TAIL_FACTOR = 10
# A run that takes longer has stalled (a stream that neither moves nor ends): it fails instead of hanging.
RUN_TIMEOUT_S = 600.0
# Runs of a batch whose clients fell behind the server (``ClientsBehind``) before one is timed or the batch fails.
ATTEMPTS = 3
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ApiRun:
    """One timed window: its seconds and decode steps, and the CPU seconds the scheduler process and the clients
    spent in it."""

    wall_s: float
    steps: int
    scheduler_cpu_s: float
    client_cpu_s: float
    # The scheduler's process alone, without its API process: the share the engine loop's GIL is held
    own_cpu_s: float = 0.0
    # What a reader sees of the pacing: the window's messages (each read with its tokens), and the time between two
    # messages of one stream, median and 99th percentile
    tokens_per_message: float = 0.0
    gap_p50_ms: float = 0.0
    gap_p99_ms: float = 0.0


class ClientsBehind(RuntimeError):
    """The clients read a window's tokens only after the server had computed them all (they waited in the server's
    and the sockets' buffers while the clients had no CPU): the window timed nothing."""


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    """``own_cpu_s`` of process ``pid`` and of its live children (the scheduler's API process, with
    ``--api-process``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return own_cpu_s(pid) + sum(process_cpu_s(int(child)) for child in children)


def start_serving(children: list[tuple[str, int, list[str]]]) -> list[Child]:
    """Start each (name, port, python arguments) child in turn, once the one before serves; a child that fails to
    serve stops the ones before it."""
    with contextlib.ExitStack() as started:
        serving = []
        for name, port, argv in children:
            child = started.enter_context(Child(name, [sys.executable, *argv]))
            child.wait_serving(f"{HOST}:{port}", timeout_s=60)
            serving.append(child)
        started.pop_all()
    return serving


class ApiPeer:
    """Child processes that serve the public API on ``port``, the last of them being the one that streams."""

    def __init__(self, port: int, children: list[Child], tail_factor: int = TAIL_FACTOR,
                 protocol: str = "nanoserve", http_port: int = 0, remote_clients: bool = False) -> None:
        self.children = children
        self.clients = Clients(port, children[-1].process.pid, tail_factor, protocol, http_port)
        # The clients run in a process of their own in SCHED_IDLE, as if on other machines.
        self.remote_clients = remote_clients

    @classmethod
    def scheduler(cls, executor_flags: list[str], stream_interval: int = 1,
                  scheduler_flags: tuple[str, ...] = (), protocol: str = "nanoserve",
                  remote_clients: bool = False) -> ApiPeer:
        """The scheduler service at its default flags (but ``--stream-interval`` and ``scheduler_flags``) in front of
        a simulated executor with ``executor_flags``, its clients speaking ``protocol`` (in SCHED_IDLE with
        ``remote_clients``)."""
        executor_port, port = free_port(), free_port()
        http_port = free_port() if protocol == "http" else 0
        if http_port:
            scheduler_flags = (*scheduler_flags, "--http-port", str(http_port))
        return cls(port, start_serving([
            ("api's simulated executor", executor_port, [
                "-m", "executor_svc.fakes.simulated", "--host", HOST, "--port", str(executor_port), *executor_flags]),
            ("api's scheduler", port, [
                "-m", "scheduler_svc", "--executor", f"{HOST}:{executor_port}", "--host", HOST, "--port", str(port),
                "--http-port", "0", "--log-level", "WARNING", "--stream-interval", str(stream_interval),
                *scheduler_flags]),
        ]), protocol=protocol, http_port=http_port, remote_clients=remote_clients)

    @classmethod
    def floor(cls, step_ms: float) -> ApiPeer:
        """``bench.stream_floor``: gRPC Python streaming one token per stream per step, and nothing else."""
        port = free_port()
        return cls(port, start_serving([("streaming floor", port, [
            "-m", "bench.stream_floor", "--host", HOST, "--port", str(port), "--step-ms", str(step_ms)])]),
            FLOOR_TAIL_FACTOR)

    def time_decode(self, batch: int, context: int, warmup: int, steps: int, vocab_size: int) -> ApiRun:
        """One timed window; a run whose clients fell behind (``ClientsBehind``) timed nothing and is run again, up
        to ``ATTEMPTS`` runs in all."""
        run = (batch, context, warmup, steps, vocab_size)
        for _ in range(ATTEMPTS - 1):
            try:
                return self._time_decode(*run)
            except ClientsBehind as e:
                print(f"{e}; running it again", file=sys.stderr)
        return self._time_decode(*run)

    def _time_decode(self, *run: int) -> ApiRun:
        if not self.remote_clients:
            return self.clients.time_decode(*run)
        with multiprocessing.get_context("spawn").Pool(1, initializer=idle_class) as pool:
            result, policy = pool.apply(idle_clients, (self.clients, *run))
        if policy != os.SCHED_IDLE:
            raise RuntimeError(f"the clients' process ran in scheduling class {policy}, not SCHED_IDLE")
        return result

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()


@dataclass(frozen=True)
class Clients:
    """The clients of a run, streaming from the server on ``port`` (process ``server_pid``, whose CPU is counted);
    plain fields, so that a process of their own can run them."""

    port: int
    server_pid: int
    tail_factor: int = TAIL_FACTOR
    # "nanoserve": nanoserve.v1's Generate; "vllm": the gateways' VllmEngine/Generate; "http": /v1/completions
    protocol: str = "nanoserve"
    http_port: int = 0

    def time_decode(self, batch: int, context: int, warmup: int, steps: int, vocab_size: int) -> ApiRun:
        async def bounded() -> ApiRun:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                return await self._decode(batch, context, warmup, steps, vocab_size)

        return asyncio.run(bounded())

    async def _decode(self, batch: int, context: int, warmup: int, steps: int, vocab_size: int) -> ApiRun:
        rng = random.Random(batch)
        prompts = [[rng.randrange(vocab_size) for _ in range(context)] for _ in range(batch)]
        marks = (warmup, warmup + steps)
        reached = {mark: 0 for mark in marks}
        events = {mark: asyncio.Event() for mark in marks}
        async with AsyncClient(f"{HOST}:{self.port}") as client:

            max_tokens = warmup + steps * (1 + self.tail_factor)
            counts = [0] * batch  # tokens each stream has read
            last_read = [0.0] * batch  # when each stream last read a message in the timed window
            gaps: list[float] = []  # seconds between two messages of a stream, in the timed window
            window_tokens = [0]

            def chunks(prompt: list[int]) -> AsyncIterator[list[int]]:
                if self.protocol == "vllm":
                    return vllm_chunks(engine, prompt, max_tokens)
                if self.protocol == "http":
                    return http_chunks(self.http_port, model, prompt, max_tokens)
                return (chunk.token_ids async for chunk in client.stream(
                    token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

            async def stream(index: int, prompt: list[int]) -> int:
                async for token_ids in chunks(prompt):
                    before = counts[index]
                    counts[index] += len(token_ids)
                    if marks[0] <= before < marks[1]:
                        now = time.perf_counter()
                        if last_read[index]:
                            gaps.append(now - last_read[index])
                            window_tokens[0] += len(token_ids)
                        last_read[index] = now
                    for mark in marks:
                        if before < mark <= counts[index]:
                            reached[mark] += 1
                            if reached[mark] == batch:
                                events[mark].set()
                return counts[index]

            before = await client.stats()  # the client's channel is open from here on
            engine = vllm_grpc.VllmEngineStub(client.channel)
            model = (await client.model_info()).model_id if self.protocol == "http" else ""
            tasks = [asyncio.create_task(stream(index, prompt)) for index, prompt in enumerate(prompts)]
            window = []
            try:
                for mark in marks:
                    marked = asyncio.create_task(events[mark].wait())
                    done, _ = await asyncio.wait([marked, *tasks], return_when=asyncio.FIRST_COMPLETED)
                    marked.cancel()
                    if not events[mark].is_set():  # a stream ended early: its error, or it stopped short
                        ended = min(task.result() for task in done if task is not marked)
                        behind = [count for count in counts if count < mark]
                        raise RuntimeError(f"batch {batch}: a stream ended after {ended} of its {max_tokens} tokens "
                                           f"while {len(behind)} had fewer than {mark} (the fewest {min(behind)})")
                    stats = await client.stats()
                    pid = self.server_pid
                    # Decode passes: a multi-step plan is one of num_steps but a token of each stream per pass
                    # (the floor counts no tokens: its steps are passes).
                    passes = stats.num_generation_tokens / batch if stats.num_generation_tokens else stats.num_steps
                    window.append((time.perf_counter(), passes, process_cpu_s(pid), time.thread_time(),
                                   own_cpu_s(pid)))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            after = await client.stats()
            while after.num_running or after.num_waiting:  # the cancelled streams' requests are aborted
                await asyncio.sleep(0.01)
                after = await client.stats()
        if after.num_preemptions != before.num_preemptions:
            raise RuntimeError("a sequence was preempted: the executor's KV cache is too small for the batch")
        (t0, s0, c0, k0, o0), (t1, s1, c1, k1, o1) = window
        if round(s1 - s0) < 1:
            raise ClientsBehind(f"batch {batch}: the clients read the timed window only once the server had computed "
                                f"it (no decode pass between its marks): they fell behind, on a busy machine")
        if not gaps:
            return ApiRun(t1 - t0, round(s1 - s0), c1 - c0, k1 - k0, o1 - o0)
        return ApiRun(t1 - t0, round(s1 - s0), c1 - c0, k1 - k0, o1 - o0, window_tokens[0] / len(gaps),
                      1e3 * percentile(gaps, 50), 1e3 * percentile(gaps, 99))


def idle_class() -> None:
    """This process's threads, and those it starts, in SCHED_IDLE: they take only the CPU the server's processes
    leave, as clients on other machines take none of it."""
    yield_cpu(thread_ids())


def idle_clients(clients: Clients, *run: int) -> tuple[ApiRun, int]:
    """In the clients' own process: the run, and the scheduling class it ran in."""
    return clients.time_decode(*run), os.sched_getscheduler(0)


async def vllm_chunks(engine: vllm_grpc.VllmEngineStub, prompt: list[int], max_tokens: int
                      ) -> AsyncIterator[list[int]]:
    """The token ids of each chunk of a greedy VllmEngine stream, as a gateway reads them."""
    request = vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=prompt), stream=True,
                                   sampling_params=vllm.SamplingParams(temperature=0, ignore_eos=True,
                                                                       max_tokens=max_tokens))
    async for response in engine.Generate(request):
        if response.HasField("chunk"):
            yield list(response.chunk.token_ids)


async def http_chunks(port: int, model: str, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
    """The token ids of each event of a greedy ``/v1/completions`` stream. HTTP/1.0, so the events come without
    chunked framing; only the token ids are parsed, so the clients take less of the CPU than the server's JSON."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    try:
        head, _, rest = (await reader.readuntil(b"\r\n\r\n")).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"/v1/completions answered {head.splitlines()[0].decode()}: {await reader.read()}")
        buffer = rest
        while data := await reader.read(1 << 16):
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                start = event.find(b'"token_ids":[')
                if start >= 0:
                    yield json.loads(event[start + 12: event.index(b"]", start) + 1])
    finally:
        writer.close()
