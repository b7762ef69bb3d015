"""Shared fixtures: every scheduler a test builds must end with all KV blocks free."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator

# Before torch loads: OpenMP's default spin-waiting makes small ops many times slower on shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api import frontend
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.engine import Engine

EOS = 0


def pytest_configure(config: pytest.Config) -> None:
    """``NANOSERVE_CPU_KERNELS`` (``make test-kernels``) forces the CPU kernel choice of every executor a test builds
    without naming one, as it does an executor started from the command line: the choice this machine measures
    cannot hide a failure of the kernels it did not choose."""
    forced = os.environ.get("NANOSERVE_CPU_KERNELS")
    if forced:
        force_cpu_kernels(forced)


def force_cpu_kernels(flag: str) -> None:
    """``ExecutorOptions`` built without ``cpu_kernels`` get ``flag``; those that name one keep it."""
    from executor_svc.cpu.choice import parse_override
    from executor_svc.runtime.config import ExecutorOptions

    try:
        parse_override(flag)
    except ValueError as e:  # stop the run here, not in every model test
        raise pytest.UsageError(f"NANOSERVE_CPU_KERNELS={flag}: {e}") from None
    init = ExecutorOptions.__init__

    @functools.wraps(init)
    def init_forced(self: ExecutorOptions, *args: object, cpu_kernels: str = flag, **kwargs: object) -> None:
        init(self, *args, cpu_kernels=cpu_kernels, **kwargs)

    ExecutorOptions.__init__ = init_forced


def run_to_completion(scheduler: Scheduler, token: int = 7) -> None:
    """Feed a non-EOS token to every step until the queues are empty."""
    while not scheduler.is_finished():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [token] * len(seqs), is_prefill)


def assert_all_blocks_free(block_manager: BlockManager) -> None:
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert not block_manager.used_block_ids
    assert all(b.ref_count == 0 for b in block_manager.blocks)
    for h, block_ids in block_manager.hash_to_block_ids.items():
        assert block_ids, "a hash names no block"
        for block_id in block_ids:
            assert block_manager.blocks[block_id].hash == h, "a hash points to a reused block"
    assert all(block_id in block_manager.hash_to_block_ids.get(h, ()) for h, block_id in block_manager.named.items())
    assert not block_manager.revived, "a revived copy was never named nor freed"


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., Scheduler]]:
    """Build bare schedulers; at teardown each is run to completion and must free every block."""
    made: list[Scheduler] = []

    def make(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
             max_model_len: int = 4096) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            BlockManager(num_blocks, block_size),
            {EOS},
            max_model_len,
        )
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        run_to_completion(scheduler)
        assert_all_blocks_free(scheduler.block_manager)


@pytest.fixture
def make_shadow_engine() -> Iterator[Callable[..., tuple[Engine, ShadowExecutor]]]:
    """Engines over a shadow executor; at teardown no block is held and the executor holds no request."""
    made: list[tuple[Engine, ShadowExecutor]] = []

    def make(num_blocks: int = 32, block_size: int = 4, vocab_size: int = 50, max_num_seqs: int = 8,
             max_num_batched_tokens: int = 64, max_model_len: int = 4096) -> tuple[Engine, ShadowExecutor]:
        executor = ShadowExecutor(num_blocks, block_size, vocab_size, (EOS,), max_model_len)
        engine = Engine(executor, SchedulerConfig(max_num_seqs, max_num_batched_tokens))
        made.append((engine, executor))
        return engine, executor

    yield make
    for engine, executor in made:
        while engine.has_unfinished():
            engine.step()
        engine.step()
        assert_all_blocks_free(engine.block_manager)
        assert len(executor.table) == 0, "the executor still holds requests the scheduler finished"


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[pb.GenerateRequest]:
    """Every GenerateRequest the HTTP API sends on, as the scheduler prepares it (in the scheduler's process: with
    the API process, its own requests only reach it through the link)."""
    requests: list[pb.GenerateRequest] = []
    prepare = frontend.prepare

    def recording(request: pb.GenerateRequest, *args: object) -> object:
        requests.append(request)
        return prepare(request, *args)

    monkeypatch.setattr(frontend, "prepare", recording)
    return requests
