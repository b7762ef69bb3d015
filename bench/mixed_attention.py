"""A mixed step's attention on the CPU, one layer, at SmolLM2-135M's shapes: the whole step through the C prefill
kernel (each decode row a request of one query) against the split the executor runs (the C decode kernel on the
decode rows, the C prefill kernel on the chunk); and the whole forward pass of SmolLM2-135M both ways (``--model``).

A step is ``--decodes`` decode rows of context drawn from 100-600 tokens beside one prefill chunk (``--chunks``,
``TOKENS`` or ``TOKENS:PREFIX`` for a chunk after a cached prefix), packed by ``prepare_input``, in a cache much larger
than the CPU's caches. Each figure is the median of ``--repeats`` timings, the two ways taking turns, because the
machines this ran on were shared; ``ratio`` is the whole step's time over the split's. JSON:
``{dtype}_{decodes}_{chunk}_{prefix}_{whole,split}_ms`` (attention) and ``..._forward_{whole,split}_ms``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()

import torch  # noqa: E402

from bench.common import print_table, progress, write_json  # noqa: E402
from common.step import SamplingSettings  # noqa: E402
from executor_svc.attention import cpu_backend  # noqa: E402
from executor_svc.attention.base import split_attention  # noqa: E402
from executor_svc.attention.cpu_backend import CpuAttention  # noqa: E402
from executor_svc.core.request_table import RequestState, ScheduledChunk  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions  # noqa: E402
from executor_svc.runtime.model_input import ModelInput, prepare_input  # noqa: E402
from executor_svc.runtime.model_runner import ModelRunner  # noqa: E402
from executor_svc.runtime.registry import DEFAULT_MODEL, resolve_model  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
NUM_BLOCKS = 8192  # 50-100 MB per cache: past the CPU's caches, as 30 layers' are


def mixed_step(decodes: int, chunk: int, prefix: int, num_blocks: int, gen: torch.Generator) -> ModelInput:
    """A new prompt's chunk ahead of the decode rows (the planner sends new requests first), on distinct blocks of
    the first ``num_blocks``."""
    lengths = [prefix + chunk] + torch.randint(100, 601, (decodes,), generator=gen).tolist()
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = []
    for i, length in enumerate(lengths):
        table = [ids.pop() for _ in range(-(-length // BLOCK_SIZE))]
        state = RequestState(i, [0] * length, table, 0, SamplingSettings(), length)
        chunks.append(ScheduledChunk(state, prefix if i == 0 else length - 1, chunk if i == 0 else 1))
    return prepare_input(chunks, BLOCK_SIZE)


def attention_ways(dtype: torch.dtype, caches: tuple[torch.Tensor, torch.Tensor], step: ModelInput,
                   gen: torch.Generator) -> tuple[Callable[[], object], Callable[[], object]]:
    """(whole, split): one layer's attention after the step's keys and values are stored."""
    rows = step.input_ids.shape[0]
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM)
    backend, meta, scale = CpuAttention(), step.meta, HEAD_DIM**-0.5
    backend.store_kv(k, v, *caches, meta.slot_mapping)
    return (lambda: backend.kernel_prefill(q, k, v, *caches, meta, scale),
            lambda: split_attention(backend, q, k, v, *caches, meta, scale))


def forward_ways(runner: ModelRunner, step: ModelInput) -> tuple[Callable[[], object], Callable[[], object]]:
    """(whole, split): the model's forward pass with every layer's attention one way or the other."""
    whole = copy.copy(step)
    whole.meta = copy.copy(step.meta)
    whole.meta.mixed = None
    return lambda: runner.execute(whole), lambda: runner.execute(step)


def alternate(ways: tuple[Callable[[], object], Callable[[], object]], repeats: int, calls: int) -> list[float]:
    """Median ms of each way, the two timed in turns."""
    times: list[list[float]] = [[], []]
    for way in ways:
        way()
    for _ in range(repeats):
        for i, way in enumerate(ways):
            start = time.perf_counter()
            for _ in range(calls):
                way()
            times[i].append((time.perf_counter() - start) / calls * 1e3)
    return [statistics.median(t) for t in times]


def measure(case: tuple[int, int, int], dtype: torch.dtype, caches: tuple[torch.Tensor, torch.Tensor],
            runner: ModelRunner | None, num_blocks: int, repeats: int, gen: torch.Generator,
            figures: dict[str, float]) -> list[object]:
    """One table row; its figures go into ``figures``."""
    decodes, chunk, prefix = case
    step = mixed_step(decodes, chunk, prefix, num_blocks, gen)
    key = f"{str(dtype).removeprefix('torch.')}_{decodes}_{chunk}_{prefix}"
    whole, split = alternate(attention_ways(dtype, caches, step, gen), repeats, 5)
    row = [decodes, chunk, prefix, whole, split, whole / split]
    figures[f"{key}_whole_ms"], figures[f"{key}_split_ms"] = whole, split
    if runner is not None:
        whole, split = alternate(forward_ways(runner, step), repeats, 1)
        row += [whole, split, whole / split]
        figures[f"{key}_forward_whole_ms"], figures[f"{key}_forward_split_ms"] = whole, split
    return row


def chunk_arg(text: str) -> tuple[int, int]:
    tokens, _, prefix = text.partition(":")
    return int(tokens), int(prefix or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mixed_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--decodes", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    parser.add_argument("--chunks", type=chunk_arg, nargs="+", default=[(64, 0), (256, 0), (512, 0), (256, 512)],
                        help="prefill chunks, TOKENS or TOKENS:PREFIX (default: 64 256 512 256:512)")
    parser.add_argument("--model", action="store_true",
                        help="also time SmolLM2-135M's whole forward pass both ways (the C kernels throughout; the "
                             "split at any count of decode rows, the CPU backend's threshold set aside)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (W1: 2)")
    parser.add_argument("--repeats", type=int, default=21, help="timings per way and shape (median)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    runner, num_blocks = None, NUM_BLOCKS
    if args.model:
        options = ExecutorOptions(dtype=args.dtype, threads=args.threads, kv_cache_memory=2 << 30, cpu_kernels="c")
        runner = ModelRunner(resolve_model(DEFAULT_MODEL), options)
        num_blocks = min(num_blocks, runner.num_blocks)
    table, figures = [], {}
    cases = [(d, c, p) for d in args.decodes for c, p in args.chunks]
    # The split at every count of decode rows: what the CPU backend's threshold weighs.
    with mock.patch.object(cpu_backend, "MIN_SPLIT_DECODES", 1):
        for case in progress(cases, desc="mixed steps"):
            table.append(measure(case, dtype, caches, runner, num_blocks, args.repeats, gen, figures))
    print(f"{args.dtype}, {args.threads} threads, medians of {args.repeats}")
    headers = ["decode rows", "chunk", "prefix", "whole ms", "split ms", "ratio"]
    print_table(headers + (["forward whole ms", "forward split ms", "forward ratio"] if runner else []), table)
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
