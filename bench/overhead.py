"""W4: scheduler + RPC overhead per decode step, with a null executor behind the real gRPC hop.

The null executor (``executor_svc.shadow_server --null``) runs in its own process and
answers every plan with a fixed token at once, so a step's time is all scheduling,
plan building, the RPC (serialise, transport, deserialise) and postprocessing. The same
steps against a NullExecutor in this process (no gRPC) are the peer that makes the
hop's cost visible as a ratio. Each batch runs its prefills first, then times
``--steps`` decode steps of ``--batch`` sequences of context ``--context``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import HOST, Child, free_port, print_table, progress, write_json
from executor_svc.shadow_server import NullExecutor, model_free_info
from executor_svc.shadow_server import parse_args as null_server_args
from scheduler_svc.engine import Engine
from scheduler_svc.executor import Executor
from scheduler_svc.remote import RemoteExecutor
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import SchedulerConfig

BLOCK_SIZE = 16
VOCAB_SIZE = 32000


@dataclass
class Phases:
    """Mean microseconds per decode step of each phase, and of the whole ``Engine.step`` call."""

    schedule_us: float
    plan_us: float
    execute_us: float
    postprocess_us: float
    wall_us: float

    @property
    def total_us(self) -> float:
        """Schedule + plan + execute + postprocess: the W4 figure."""
        return self.schedule_us + self.plan_us + self.execute_us + self.postprocess_us

    @staticmethod
    def median(runs: list[Phases]) -> Phases:
        return Phases(*(statistics.median(getattr(r, f) for r in runs) for f in Phases.__dataclass_fields__))


def geometry(batch: int, context: int, steps: int) -> tuple[int, int]:
    """(max_model_len, num_blocks) so that ``batch`` sequences decode ``steps`` tokens past ``context`` unpreempted."""
    max_model_len = context + steps + BLOCK_SIZE
    return max_model_len, batch * -(-max_model_len // BLOCK_SIZE)


def time_decode(executor: Executor, batch: int, context: int, warmup: int, steps: int) -> Phases:
    """Prefill ``batch`` distinct prompts of ``context`` tokens, then time ``steps`` decode steps after ``warmup``."""
    engine = Engine(executor, SchedulerConfig(max_num_seqs=max(batch, 1)))
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=engine.info.max_model_len - context, ignore_eos=True)
    seqs = [engine.add_request([rng.randrange(VOCAB_SIZE) for _ in range(context)], params) for _ in range(batch)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    sums = [0.0] * 5
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        t = engine.last_timings
        for i, v in enumerate((t.schedule_s, t.plan_s, t.execute_s, t.postprocess_s, wall)):
            sums[i] += v
    assert all(len(s.token_ids) == context + 1 + warmup + steps for s in seqs), "a sequence was preempted"
    for seq in seqs:
        engine.abort(seq)
    engine.step()
    return Phases(*(1e6 * s / steps for s in sums))


def null_server(port: int, max_model_len: int, num_blocks: int) -> Child:
    argv = [sys.executable, "-m", "executor_svc.shadow_server", "--null", "--host", HOST, "--port", str(port),
            "--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE), "--vocab-size", str(VOCAB_SIZE),
            "--max-model-len", str(max_model_len), "--log-level", "WARNING"]
    return Child("null executor", argv)


def in_process_null(max_model_len: int, num_blocks: int) -> NullExecutor:
    args = null_server_args(["--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE),
                             "--vocab-size", str(VOCAB_SIZE), "--max-model-len", str(max_model_len)])
    return NullExecutor(model_free_info(args, "null", "", ""))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256],
                        help="running sequences per decode step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence when timing starts "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed decode steps first (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per batch and peer; medians are reported "
                        "(default: %(default)s)")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process peer")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    max_model_len, num_blocks = geometry(max(args.batch), args.context, args.warmup + args.steps)
    port = free_port()
    peers = ["grpc"] + ([] if args.no_inprocess else ["in-process"])
    results: dict[tuple[str, int], Phases] = {}
    with null_server(port, max_model_len, num_blocks) as server:
        target = f"{HOST}:{port}"
        server.wait_serving(target, timeout_s=60)
        remote = RemoteExecutor(target)
        local = in_process_null(max_model_len, num_blocks)
        runs = [(peer, batch) for batch in args.batch for peer in peers]
        with progress(total=len(runs) * args.repeats, desc="W4 decode runs") as bar:
            for peer, batch in runs:
                executor = remote if peer == "grpc" else local
                timed = []
                for _ in range(args.repeats):
                    timed.append(time_decode(executor, batch, args.context, args.warmup, args.steps))
                    bar.update()
                results[peer, batch] = Phases.median(timed)
        remote.close()
    print(f"W4: decode steps of context {args.context}, null executor, median of {args.repeats} runs of "
          f"{args.steps} steps (us per step)")
    rows = []
    for (peer, batch), p in results.items():
        ratio = p.total_us / results["in-process", batch].total_us if ("in-process", batch) in results else ""
        rows.append([batch, peer, p.schedule_us + p.plan_us, p.plan_us, p.execute_us, p.postprocess_us, p.total_us,
                     1e6 / p.wall_us, ratio])
    print_table(["batch", "executor", "schedule+plan", "(plan)", "execute/RPC", "postprocess", "total",
                 "steps/s", "x in-process"], rows)
    figures = figures_of(results, args.context, args.steps, args.repeats)
    write_json(args.json, figures)
    return figures


def figures_of(results: dict[tuple[str, int], Phases], context: int, steps: int, repeats: int) -> dict[str, float]:
    figures: dict[str, float] = {"context": context, "steps": steps, "repeats": repeats}
    for (peer, batch), p in results.items():
        prefix = "" if peer == "grpc" else "inprocess_"
        figures[f"{prefix}us_per_step_b{batch}"] = p.total_us
        figures[f"{prefix}steps_per_s_b{batch}"] = 1e6 / p.wall_us
        figures[f"{prefix}schedule_us_b{batch}"] = p.schedule_us + p.plan_us
        figures[f"{prefix}plan_us_b{batch}"] = p.plan_us
        figures[f"{prefix}{'rpc' if peer == 'grpc' else 'execute'}_us_b{batch}"] = p.execute_us
        figures[f"{prefix}postprocess_us_b{batch}"] = p.postprocess_us
    for batch in {b for _, b in results}:
        if ("in-process", batch) in results and ("grpc", batch) in results:
            figures[f"grpc_over_inprocess_b{batch}"] = (
                results["grpc", batch].total_us / results["in-process", batch].total_us)
    return figures


if __name__ == "__main__":
    main()
