"""Multi-LoRA serving: W1 with its requests spread round robin over 4 LoRA adapters, against W1 on the base model, on
the same executor in the same run (in-process: the scheduler Engine and the ModelExecutor, CPU, the embedded model).

The adapters are random rank-``--rank`` factors on every projection (q, k, v, o, gate, up, down), written in PEFT's
format at start-up. A round of each peer runs first, not counted, so that neither pays for first use (the heap, the
KV cache's pages, the adapters' paths); then rounds alternate between the two peers (``--repeats``; in reverse every
other round). Every round draws prompts of its own (W1's lengths, new ids; the two peers of a round share them): the
one engine serves every round, and a round must not find an earlier one's blocks in its prefix cache. Each peer's
figure is the median of its rounds' seconds, with their spread, and the ratio of each round's pair; the target is
adapters <= 1.3x the base model's time on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from executor_svc.cpu.malloc import keep_heap_memory
from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()
keep_heap_memory()

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.common import WARMUP_PROMPT, WORKLOADS, Workload, print_table, progress, write_json  # noqa: E402
from common.heap import freeze_startup_heap  # noqa: E402
from executor_svc.cpu.cpuinfo import cpuinfo  # noqa: E402
from executor_svc.lora.adapter import PROJECTIONS, projection_shape  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions, ModelConfig  # noqa: E402
from executor_svc.runtime.model_executor import ModelExecutor  # noqa: E402
from executor_svc.runtime.registry import DEFAULT_MODEL, resolve_model  # noqa: E402
from scheduler_svc.core.sampling import SamplingParams  # noqa: E402
from scheduler_svc.core.scheduler import SchedulerConfig  # noqa: E402
from scheduler_svc.engine.engine import Engine  # noqa: E402

NUM_ADAPTERS = 4
PEERS = ("base", "adapters")


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A random LoRA adapter on every projection of every layer, as PEFT saves one."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for projection, room in PROJECTIONS.items():
            out_features, in_features = projection_shape(config, projection)
            key = f"base_model.model.model.layers.{layer}.{room}.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def run(engine: Engine, peer: str, workload: Workload) -> tuple[float, float]:
    """Wall and CPU seconds (this process's threads, all of them) to generate the workload, each request through the
    base model or round robin over the adapters. On a machine shared with other work the CPU seconds move less."""
    names = [f"lora{i % NUM_ADAPTERS}" if peer == "adapters" else None for i in range(len(workload.prompts))]
    start, cpu_start = time.perf_counter(), time.process_time()
    for prompt, max_tokens, name in zip(workload.prompts, workload.max_tokens, names, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), name)
    with progress(total=sum(workload.max_tokens), desc=peer) as bar:
        while engine.has_unfinished():
            bar.update(sum(len(out.token_ids) for out in engine.step()))
    return time.perf_counter() - start, time.process_time() - cpu_start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank (default: 16)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds per peer (default: 1)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--num-requests", type=int, default=None, help="the workload's first N requests (default: all)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens (default: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]()
    count = args.num_requests or len(workload.prompts)
    workload = replace(workload, prompts=workload.prompts[:count], max_tokens=[
        min(n, args.max_tokens or n) for n in workload.max_tokens[:count]])
    load_before = load_average()
    folder = resolve_model(args.model)
    config = ModelConfig.from_folder(folder)
    with tempfile.TemporaryDirectory() as root:
        adapters = {f"lora{i}": str(write_adapter(Path(root) / f"lora{i}", config, args.rank, seed=i))
                    for i in range(NUM_ADAPTERS)}
        options = ExecutorOptions(model=args.model, dtype=args.dtype, kv_cache_memory=2 << 30, threads=args.threads,
                                  max_model_len=workload.max_model_len, lora_modules=adapters,
                                  max_lora_rank=args.rank)
        engine = Engine(ModelExecutor(options), SchedulerConfig(num_scheduler_steps=8, max_loras=NUM_ADAPTERS))
        for name in (None, *adapters):
            engine.generate([WARMUP_PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), [name])
        freeze_startup_heap()  # as bench.throughput's in-process peer and both services do once built
        for peer in PEERS:
            run(engine, peer, workload.redrawn(0))
        seconds: dict[str, list[float]] = {peer: [] for peer in PEERS}
        cpu: dict[str, list[float]] = {peer: [] for peer in PEERS}
        for round_ in range(args.repeats):
            for peer in PEERS if round_ % 2 == 0 else reversed(PEERS):
                wall, used = run(engine, peer, workload.redrawn(round_ + 1))
                seconds[peer].append(wall)
                cpu[peer].append(used)
    report(args, workload, seconds, cpu, load_before)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: above the threads used, other work shared the CPU."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(args: argparse.Namespace, workload: Workload, seconds: dict[str, list[float]],
           cpu: dict[str, list[float]], load_before: str) -> None:
    """The medians, each peer's fastest and slowest rounds (the spread) and the rounds' own ratios."""
    median = {peer: statistics.median(times) for peer, times in seconds.items()}
    median_cpu = {peer: statistics.median(times) for peer, times in cpu.items()}
    paired = [adapters / base for base, adapters in zip(seconds["base"], seconds["adapters"], strict=True)]
    tokens = sum(workload.max_tokens)
    cpu_name = cpuinfo("model name").partition(":")[2].strip() or "CPU not named"
    print(f"{cpu_name}, {torch.get_num_threads()} threads, {args.dtype}; load average {load_before} at the start, "
          f"{load_average()} at the end")
    print_table(["peer", "seconds", "rounds' spread (s)", "tok/s", "x base", "CPU seconds", "x base (CPU)"],
                [[peer, median[peer], f"{min(seconds[peer]):.2f}-{max(seconds[peer]):.2f}", tokens / median[peer],
                  median[peer] / median["base"], median_cpu[peer], median_cpu[peer] / median_cpu["base"]]
                 for peer in PEERS])
    print("rounds' adapters / base:", ", ".join(f"{ratio:.2f}x" for ratio in paired),
          f"(median {statistics.median(paired):.2f}x)")
    write_json(args.json, {"seconds": seconds, "cpu_seconds": cpu, "ratio": median["adapters"] / median["base"],
                           "cpu_ratio": median_cpu["adapters"] / median_cpu["base"], "paired_ratios": paired,
                           "rank": args.rank, "threads": torch.get_num_threads(), "dtype": args.dtype,
                           "workload": args.workload, "cpu": cpu_name})


if __name__ == "__main__":
    main()
