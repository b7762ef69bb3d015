"""Helpers for the scheduler-service tests: real subprocess stacks, in-process servers, a small tokenizer.

Every test that runs requests ends with ``assert_idle``: no request left and
every KV block free, as GetStats reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from nanoserve.v1 import executor_pb2, executor_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api.grpc_service import SchedulerServer
from scheduler_svc.config import ServiceConfig

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 10.0

# ChatML, as SmolLM2 and Qwen use it.
# ChatML, with Qwen3's switch: ``enable_thinking`` false (a chat_template_kwargs) writes an empty thought.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 0  # <|endoftext|>
# Trained on; text outside it (other CJK, other emoji) falls back to single bytes, split across tokens.
CORPUS = ["Hello world, héllo wörld!", "你好，世界。你好吗？", "emoji 🎉🚀 party 🎉", "The quick brown fox jumps."]
TOKENIZER_VOCAB_SIZE = 300

SERVING = health_pb2.HealthCheckResponse.SERVING


def ephemeral_floor() -> int:
    """Where the kernel's ephemeral ports start: it hands those to bind(0) and to every outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this process handed out: a test starts several services, each on a port of its own.
_handed_out: set[int] = set()


def worker_ports(low: int, high: int) -> tuple[int, int]:
    """This test worker's share of [low, high): pytest-xdist's workers each draw from their own, so that two never
    hand out the same port (each knows only its own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    span = (high - low) // max(count, 1)
    return low + index * span, low + (index + 1) * span


def free_port() -> int:
    """A port nothing listens on, for a service started next. Drawn below the ephemeral range, so that no outgoing
    connection of either test worker takes it as its source port before the service binds it (bind(0) would hand out
    a port from that very range), and never the same twice in this process."""
    floor = ephemeral_floor()
    low, high = worker_ports(max(1024, floor - 12000), floor)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE small enough to train in milliseconds; multi-byte characters split across its tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def wait_health(
    target: str, process: subprocess.Popen, statuses: tuple[int, ...] = (SERVING,), timeout_s: float = START_TIMEOUT_S
) -> int:
    """Block until ``target`` reports one of ``statuses`` through grpc.health.v1; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{process.args} exited with {process.returncode}"
            with contextlib.suppress(grpc.RpcError):
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status in statuses:
                    return status
            time.sleep(0.05)
    raise TimeoutError(f"{target} did not report {statuses} within {timeout_s}s")


def wait_serving(target: str, process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    wait_health(target, process, (SERVING,), timeout_s)


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    log = log_path.open("w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})


def stop_process(process: subprocess.Popen) -> int:
    """SIGTERM, then wait; returns the exit code."""
    process.terminate()
    try:
        return process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@dataclass
class Stack:
    """An executor process and a scheduler process, and a channel to the scheduler."""

    executor: subprocess.Popen
    scheduler: subprocess.Popen
    executor_target: str
    target: str
    channel: grpc.Channel
    stub: pb_grpc.GenerationStub
    log_dir: Path

    def executor_reset(self) -> int:
        """Reset the executor directly; the number of requests it still held."""
        with grpc.insecure_channel(self.executor_target) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            return stub.Reset(executor_pb2.ResetRequest(), timeout=10).num_dropped_requests

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.log_dir.glob("*.log")))


def executor_argv(kind: str, port: int, options: dict[str, object]) -> list[str]:
    """The command of a model-free executor: ``shadow`` (default), ``echo`` or ``null``."""
    argv = [sys.executable, "-m", "executor_svc.fakes.shadow_server", "--host", HOST, "--port", str(port)]
    if kind in ("echo", "null"):
        argv.append(f"--{kind}")
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def scheduler_argv(port: int, executor_target: str, **flags: object) -> list[str]:
    """The command of a scheduler on ``port`` in front of ``executor_target`` (no HTTP unless asked)."""
    argv = [sys.executable, "-m", "scheduler_svc", "--host", HOST, "--port", str(port), "--executor", executor_target]
    for key, value in {"http_port": 0, **flags}.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


@contextlib.contextmanager
def running_stack(
    executor_cmd: list[str] | None, log_dir: Path, executor_port: int | None = None, **scheduler_flags: object
) -> Iterator[Stack]:
    """Start the executor (unless ``executor_cmd`` is None: then nothing listens yet) and the scheduler."""
    log_dir.mkdir(parents=True, exist_ok=True)
    executor_port = executor_port or free_port()
    executor_target = f"{HOST}:{executor_port}"
    executor = spawn(executor_cmd, log_dir / "executor.log") if executor_cmd else None
    port = free_port()
    scheduler = spawn(scheduler_argv(port, executor_target, **scheduler_flags), log_dir / "scheduler.log")
    target = f"{HOST}:{port}"
    channel = grpc.insecure_channel(target)
    try:
        if executor is not None:
            try:
                wait_serving(executor_target, executor)
                wait_serving(target, scheduler)
            except AssertionError as e:  # a process that died says why in its log
                logs = "\n".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(log_dir.glob("*.log")))
                raise AssertionError(f"{e}\n{logs}") from None
        yield Stack(executor, scheduler, executor_target, target, channel, pb_grpc.GenerationStub(channel), log_dir)
    finally:
        channel.close()
        stop_process(scheduler)
        if executor is not None:
            stop_process(executor)


def api_process_pid(scheduler_pid: int) -> int:
    """The scheduler's API process (``--api-process``, the default)."""
    (child,) = Path(f"/proc/{scheduler_pid}/task/{scheduler_pid}/children").read_text().split()
    return int(child)


def assert_idle(stub: pb_grpc.GenerationStub, timeout_s: float = IDLE_TIMEOUT_S) -> pb.SchedulerStats:
    """Wait for the scheduler to settle, then assert no request is left and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
        idle = stats.num_waiting == 0 and stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats.num_waiting == 0 and stats.num_running == 0, f"requests left behind: {stats}"
    assert stats.num_free_blocks == stats.num_blocks, f"KV blocks still held: {stats}"
    return stats


def token_request(token_ids: list[int], max_tokens: int | None = None, **stopping: object) -> pb.GenerateRequest:
    options = pb.StoppingOptions(**stopping)
    if max_tokens is not None:
        options.max_tokens = max_tokens
    return pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=token_ids), stopping=options)


@dataclass
class Collected:
    """A whole stream, joined: what a user would read."""

    text: str
    token_ids: list[int]
    finish_reason: int
    usage: pb.Usage


def collect(responses: list[pb.GenerateResponse]) -> Collected:
    """Join a stream, checking that only its last response carries the finish reason and usage."""
    *pieces, last = responses
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("usage") for r in pieces)
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED and last.HasField("usage")
    return Collected(
        "".join(r.text for r in responses),
        [t for r in responses for t in r.token_ids],
        last.finish_reason,
        last.usage,
    )


async def stream(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> Collected:
    return collect([r async for r in stub.Generate(request)])


class GatedExecutor(Executor):
    """Wraps an executor so a test can hold every step until it opens the gate.

    With ``steps_before_closing`` the gate closes by itself after that many steps, so a test can
    stop a fast executor at an exact point without racing it; ``closed`` says it has (a test that opens the gate
    before then would be shut out again by the step that closes it).
    """

    def __init__(self, inner: Executor, steps_before_closing: int | None = None) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.entered = threading.Event()
        self.closed = threading.Event()
        self.open.set()
        self.steps_before_closing = steps_before_closing

    def get_info(self) -> ExecutorInfo:
        return self.inner.get_info()

    def reset(self) -> int:
        return self.inner.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self.entered.set()
        if self.steps_before_closing is not None:
            if self.steps_before_closing == 0:
                self.open.clear()
                self.closed.set()
            self.steps_before_closing -= 1
        self.open.wait()
        return self.inner.step(plan)


@dataclass
class InProcess:
    server: SchedulerServer
    stub: pb_grpc.GenerationStub


@contextlib.asynccontextmanager
async def in_process_scheduler(executor: Executor, **config: object) -> AsyncIterator[InProcess]:
    """A scheduler server in this process around ``executor``, and an aio stub to it; stopped on exit.

    Its HTTP API is off unless ``http_port`` is given, and it serves gRPC itself unless ``api_process`` is given (the
    stacks of real processes run the API process, as by default; ``test_api_process`` runs it here too). It keeps a
    step in flight unless ``overlap`` is given, as beside an accelerator, whatever the executor's device: the paths
    overlap adds (plans booked ahead, windows cut under them) are what these tests exercise; the stacks of real
    processes run the CPU's default, one step at a time.
    """
    server = SchedulerServer(ServiceConfig(**{"host": HOST, "port": 0, "http_port": 0, "api_process": False,
                                              "overlap": True, **config}), executor)
    await server.start()
    assert await server.connect()
    channel = grpc.aio.insecure_channel(f"{HOST}:{server.port}")
    try:
        yield InProcess(server, pb_grpc.GenerationStub(channel))
    finally:
        await server.stop()
        await channel.close()


async def assert_idle_async(stub: pb_grpc.GenerationStub, timeout_s: float = IDLE_TIMEOUT_S) -> pb.SchedulerStats:
    """``assert_idle`` for an aio stub."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.GetStats(pb.GetStatsRequest())
        idle = stats.num_waiting == 0 and stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert stats.num_waiting == 0 and stats.num_running == 0, f"requests left behind: {stats}"
    assert stats.num_free_blocks == stats.num_blocks, f"KV blocks still held: {stats}"
    return stats


async def rest_of(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    """A stream's responses after those already read with ``read`` (a call is read one way only)."""
    responses = []
    while (response := await call.read()) != grpc.aio.EOF:
        responses.append(response)
    return responses
