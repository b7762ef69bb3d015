"""An in-process scheduler serving HTTP on its own event-loop thread, so sync and async HTTP clients both reach it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai

from common.executor import Executor
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api.grpc_service import SchedulerServer
from tests.service_fixtures import HOST, IDLE_TIMEOUT_S, free_port, in_process_scheduler

START_TIMEOUT_S = 30.0


@dataclass
class Hosted:
    server: SchedulerServer
    url: str
    stub: pb_grpc.GenerationStub

    def openai(self, api_key: str = "none", **options: object) -> openai.OpenAI:
        """No retries: a test sees the first answer, errors included."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def async_openai(self, api_key: str = "none", **options: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def assert_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """``service_fixtures.assert_idle`` on the snapshot GetStats returns, read here: no API key or TLS needed."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.server.frontend.stats()
            idle = stats.num_waiting == 0 and stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert stats.num_waiting == 0 and stats.num_running == 0, f"requests left behind: {stats}"
        assert stats.num_free_blocks == stats.num_blocks, f"KV blocks still held: {stats}"


@contextlib.contextmanager
def hosted(executor: Executor, **config: object) -> Iterator[Hosted]:
    """``in_process_scheduler`` with its HTTP API on a free port, run on a thread of its own until exit; the API
    process serves it, as by default, unless ``api_process=False``."""
    port = free_port()
    started = threading.Event()
    state: dict[str, object] = {}

    async def main() -> None:
        try:
            async with in_process_scheduler(executor, http_port=port, **{"api_process": True, **config}) as s:
                state.update(server=s.server, loop=asyncio.get_running_loop(), stop=asyncio.Event())
                started.set()
                await state["stop"].wait()
        except BaseException as e:  # recorded before the waiting test wakes, so that it shows this error
            state["error"] = e
            raise
        finally:
            started.set()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # shown by the test that waited for the start
            state["error"] = e

    thread = threading.Thread(target=run, name="hosted-scheduler", daemon=True)
    thread.start()
    assert started.wait(START_TIMEOUT_S), "the scheduler did not start"
    assert "error" not in state, f"the scheduler failed: {state.get('error')!r}"
    channel = grpc.insecure_channel(f"{HOST}:{state['server'].port}")
    try:
        yield Hosted(state["server"], f"http://{HOST}:{port}", pb_grpc.GenerationStub(channel))
    finally:
        channel.close()
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(START_TIMEOUT_S)
    assert "error" not in state, f"the scheduler failed: {state.get('error')!r}"


@contextlib.contextmanager
def hosted_smollm2() -> Iterator[Hosted]:
    """The embedded SmolLM2 in float32 behind the HTTP API (the ``smollm2_folder`` fixture converts it first)."""
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=DEFAULT_MODEL, threads=2, kv_cache_memory=64 << 20))
    with hosted(executor) as h:
        yield h
        h.assert_idle()

