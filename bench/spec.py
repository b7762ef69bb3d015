"""W6 (copy-heavy) and W1: speculative decoding off, with the scheduler's n-gram proposals, and with the executor's
draft model, on one executor in one run (in-process: the scheduler Engine and the ModelExecutor, CPU, the embedded
model).

Each batch size N runs the workload's first N requests at once. The draft is the served model cut to its first
``--draft-layers`` layers (an early-exit draft: no second small model ships here). Rounds alternate between the peers
(``--repeats``; in reverse every other round) and each figure is the median of its rounds; beside the tokens per
second is the mean accepted length: tokens a verification step gave a sequence (its accepted proposals and the
executor's own token). Targets on CPU: n-gram >= 1.5x off at batch 1 on W6; on W1 speculation >= 0.97x off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from executor_svc.cpu.malloc import keep_heap_memory
from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()
keep_heap_memory()

import torch  # noqa: E402

from bench.common import WARMUP_PROMPT, WORKLOADS, Workload, print_table, write_json  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions  # noqa: E402
from executor_svc.runtime.model_executor import ModelExecutor  # noqa: E402
from executor_svc.runtime.registry import DEFAULT_MODEL  # noqa: E402
from scheduler_svc.core.sampling import SamplingParams  # noqa: E402
from scheduler_svc.core.scheduler import SchedulerConfig  # noqa: E402
from scheduler_svc.engine.engine import Engine  # noqa: E402

PEERS = ("off", "ngram", "draft")
DEFAULT_BATCHES = {"w6": [1, 8, 32], "w1": [1, 8, 64]}


def engine_for(executor: ModelExecutor, peer: str, args: argparse.Namespace) -> Engine:
    """A fresh engine at the serving defaults' steps per plan, speculating as ``peer`` says."""
    executor.reset()
    speculation = {} if peer == "off" else {
        "speculative": peer, "num_speculative_tokens": args.num_speculative_tokens}
    return Engine(executor, SchedulerConfig(num_scheduler_steps=args.num_scheduler_steps, **speculation))


def run(engine: Engine, workload: Workload) -> float:
    """Wall seconds to generate the workload, every request at once."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    start = time.perf_counter()
    engine.generate(workload.prompts, params)
    return time.perf_counter() - start


def accepted_length(engine: Engine) -> float | None:
    """Mean tokens per verified sequence-step: 1 + accepted / verifications; None when nothing was verified."""
    counters = engine.scheduler.speculator.counters if engine.scheduler.speculator else None
    return 1 + counters.num_accepted_tokens / counters.num_drafts if counters and counters.num_drafts else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workload", choices=sorted(DEFAULT_BATCHES), default="w6")
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 8 32 on W6, 1 8 64 on W1)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="proposals per step (default: 4)")
    parser.add_argument("--draft-layers", type=int, default=4, help="the early-exit draft's layers (default: 4)")
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="decode steps per plan where nothing is verified (default: 8, the service's)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds per peer (default: 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens (default: none)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]()
    if args.max_tokens:
        workload = replace(workload, max_tokens=[min(n, args.max_tokens) for n in workload.max_tokens])
    batches = args.batch or DEFAULT_BATCHES[args.workload]
    draft = {"speculative_draft_layers": args.draft_layers} if "draft" in args.peers else {}
    options = ExecutorOptions(model=args.model, dtype=args.dtype, kv_cache_memory=2 << 30,
                              max_model_len=workload.max_model_len, **draft)
    executor = ModelExecutor(options)
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for peer in args.peers:
        engine_for(executor, peer, args).generate([WARMUP_PROMPT * 2], warm)
    seconds: dict[tuple[str, int], list[float]] = {}
    accepted: dict[str, list[float]] = {peer: [] for peer in args.peers}
    for batch in batches:
        head = workload.head(batch)
        for round_ in range(args.repeats):
            for peer in args.peers if round_ % 2 == 0 else reversed(args.peers):
                engine = engine_for(executor, peer, args)
                seconds.setdefault((peer, batch), []).append(run(engine, head))
                length = accepted_length(engine)
                if length is not None:
                    accepted[peer].append(length)
    figures: dict[str, object] = {"workload": args.workload, "dtype": args.dtype, "threads": torch.get_num_threads(),
                                  "num_speculative_tokens": args.num_speculative_tokens}
    rows = []
    for batch in batches:
        tokens = sum(workload.head(batch).max_tokens)
        off = statistics.median(seconds[("off", batch)]) if "off" in args.peers else None
        for peer in args.peers:
            median = statistics.median(seconds[(peer, batch)])
            figures[f"{peer}_tok_s_b{batch}"] = tokens / median
            rows.append([batch, peer, tokens / median, off / median if off else None])
    for peer in args.peers:
        if accepted[peer]:
            figures[f"{peer}_accept_len"] = statistics.mean(accepted[peer])
    print_table(["batch", "peer", "tok/s", "x off"], rows)
    print("mean accepted length: " + ", ".join(
        f"{peer} {statistics.mean(lengths):.2f}" for peer, lengths in accepted.items() if lengths))
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
