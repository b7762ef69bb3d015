"""W4: scheduler + RPC overhead per decode step, with a null executor behind the real gRPC hop.

The null executor (``executor_svc.fakes.shadow_server.NullExecutor``, served by the same
gRPC servicer as every executor) runs in its own process and answers every plan
with a fixed token at once, so a step's time is all scheduling, plan building, the
RPC (serialise, transport, deserialise) and postprocessing. Peers, same engine and
plans: ``grpc`` (the unary Step RPC), ``stream`` (the same plans over the StepStream
RPC, one at a time), ``overlap`` (the engine keeps one step in flight over StepStream,
as ``nanoserve-scheduler --overlap`` does; its figure is the wall time per step, since
its phases overlap), ``in-process`` (no gRPC), which makes the hop's cost visible
as a ratio, and ``floor`` (no engine: plan-sized bytes for result-sized bytes over a stream
to an echo method of the same child), gRPC Python's own round trip: the least a peer that waits
for each result can cost (``overlap`` keeps two in flight, so it can go under). Each batch runs
its prefills first, then times ``--steps`` decode steps of ``--batch`` sequences of context
``--context``. With ``--num-scheduler-steps N`` every peer plans N decode steps at a time
(``nanoserve-scheduler --num-scheduler-steps``) and the floor sends one message per N steps;
figures stay per decode step.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.common import HOST, Child, free_port, print_table, progress, write_json
from common.channels import EXECUTOR_CHANNEL_OPTIONS
from common.executor import Executor
from common.step import ExecutorInfo, StepPlan, StepResult
from common.step_codec import plan_to_proto, result_to_proto
from executor_svc.fakes.shadow_server import NullExecutor, model_free_info
from executor_svc.fakes.shadow_server import parse_args as null_server_args
from executor_svc.service import build_server
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor

BLOCK_SIZE = 16
VOCAB_SIZE = 32000
PEERS = ("grpc", "stream", "overlap", "in-process", "floor")
ECHO_SERVICE, ECHO_METHOD = "bench.Floor", "Echo"


@dataclass
class Phases:
    """Mean microseconds per decode step of each phase, of the whole ``Engine.step`` call, and its CPU time.

    ``cpu_us`` is this thread's CPU time per step: the scheduler's own cost, which unlike wall
    time barely moves when other processes share the cores (the RPC wait is not in it).
    """

    schedule_us: float
    plan_us: float
    execute_us: float
    postprocess_us: float
    wall_us: float
    cpu_us: float

    @property
    def total_us(self) -> float:
        """Schedule + plan + execute + postprocess: the W4 figure."""
        return self.schedule_us + self.plan_us + self.execute_us + self.postprocess_us

    @staticmethod
    def median(runs: list[Phases]) -> Phases:
        return Phases(*(statistics.median(getattr(r, f) for r in runs) for f in Phases.__dataclass_fields__))


def geometry(batch: int, context: int, steps: int, num_steps: int) -> tuple[int, int]:
    """(max_model_len, num_blocks) so that ``batch`` sequences decode ``steps`` tokens past ``context`` unpreempted,
    with room for the plans in flight (``num_steps`` decode steps each)."""
    max_model_len = context + steps + 2 * num_steps + BLOCK_SIZE
    return max_model_len, batch * -(-max_model_len // BLOCK_SIZE)


def time_decode(executor: Executor, batch: int, context: int, warmup: int, steps: int, overlap: bool,
                num_steps: int = 1) -> Phases:
    """Prefill ``batch`` distinct prompts of ``context`` tokens, then time ``steps`` decode steps after ``warmup``.

    With ``num_steps`` decode steps per plan, ``steps // num_steps`` plans are timed and every figure is per
    decode step (a plan's cost divided by ``num_steps``)."""
    config = SchedulerConfig(max_num_seqs=max(batch, 1), num_scheduler_steps=num_steps)
    engine = Engine(executor, config, overlap=overlap)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=engine.info.max_model_len - context, ignore_eos=True)
    seqs = [engine.add_request([rng.randrange(VOCAB_SIZE) for _ in range(context)], params) for _ in range(batch)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
    for _ in range(-(-warmup // num_steps)):
        engine.step()
    sums = [0.0] * 6
    plans = max(steps // num_steps, 1)
    for _ in range(plans):
        c0, t0 = time.thread_time(), time.perf_counter()
        engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        t = engine.last_timings
        for i, v in enumerate((t.schedule_s, t.plan_s, t.execute_s, t.postprocess_s, wall, cpu)):
            sums[i] += v
    assert engine.scheduler.num_preemptions == 0, "a sequence was preempted"
    for seq in seqs:
        engine.abort(seq)
    while engine.has_unfinished():
        engine.step()
    engine.step()
    return Phases(*(1e6 * s / (plans * num_steps) for s in sums))


class OneAtATimeOverStream(Executor):
    """The executor's StepStream RPC used synchronously: each plan waits for its result."""

    def __init__(self, remote: RemoteExecutor) -> None:
        self.remote = remote

    def get_info(self) -> ExecutorInfo:
        return self.remote.get_info()

    def step(self, plan: StepPlan) -> StepResult:
        return self.remote.submit(plan).result()


class SizingNull(NullExecutor):
    """The null executor noting the bytes of each decode plan and its result: the floor sends messages this size."""

    def __init__(self, info: ExecutorInfo) -> None:
        super().__init__(info)
        self.sizes: list[tuple[int, int]] = []

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        if not plan.is_prefill:
            self.sizes.append((plan_to_proto(plan).ByteSize(), result_to_proto(result).ByteSize()))
        return result


def decode_sizes(batch: int, context: int, steps: int, max_model_len: int, num_blocks: int,
                 num_steps: int) -> tuple[int, int]:
    """Median (plan, result) bytes of the decode plans the other peers time at ``batch``."""
    sizing = SizingNull(in_process_null(max_model_len, num_blocks).info)
    time_decode(sizing, batch, context, 0, steps, overlap=False, num_steps=num_steps)
    return statistics.median_low(sizing.sizes)


def time_floor(channel: grpc.Channel, sizes: tuple[int, int], warmup: int, steps: int, num_steps: int) -> Phases:
    """Time round trips of plan-sized bytes for result-sized bytes after a warm-up, sent as ``StepStream``
    sends plans: one stream fed by a queue, each message waiting for its answer. One round trip per plan
    of ``num_steps`` decode steps; figures are per decode step."""
    warmup, steps = -(-warmup // num_steps), max(steps // num_steps, 1)
    messages: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    call = channel.stream_stream(f"/{ECHO_SERVICE}/{ECHO_METHOD}")(iter(messages.get, None),
                                                                    metadata=(("reply-bytes", str(sizes[1])),))
    message = bytes(sizes[0])
    for i in range(warmup + steps):
        if i == warmup:
            c0, t0 = time.thread_time(), time.perf_counter()
        messages.put(message)
        next(call)
    decode_steps = steps * num_steps
    wall_us = 1e6 * (time.perf_counter() - t0) / decode_steps
    cpu_us = 1e6 * (time.thread_time() - c0) / decode_steps
    messages.put(None)
    return Phases(0.0, 0.0, wall_us, 0.0, wall_us, cpu_us)


def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    """The floor's server side: answer each message at once with as many bytes as the call's metadata asks."""
    reply = bytes(int(dict(context.invocation_metadata())["reply-bytes"]))
    for _ in requests:
        yield reply


def in_process_null(max_model_len: int, num_blocks: int) -> NullExecutor:
    args = null_server_args(["--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE),
                             "--vocab-size", str(VOCAB_SIZE), "--max-model-len", str(max_model_len)])
    return NullExecutor(model_free_info(args, "null", "", ""))


def serve_null(port: int, max_model_len: int, num_blocks: int) -> None:
    """The child process: the null executor behind the executor servicer, and the floor's echo on the same server."""
    server, _ = build_server(in_process_null(max_model_len, num_blocks), HOST, port)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {ECHO_METHOD: grpc.stream_stream_rpc_method_handler(echo)}),))
    server.start()
    server.wait_for_termination()


def null_server(port: int, max_model_len: int, num_blocks: int) -> Child:
    argv = [sys.executable, "-m", "bench.overhead", "--serve", str(port), "--max-model-len", str(max_model_len),
            "--num-blocks", str(num_blocks)]
    return Child("null executor", argv)


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
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per plan (multi-step "
                        "scheduling, as nanoserve-scheduler --num-scheduler-steps); figures stay per decode step "
                        "(default: %(default)s)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS),
                        help="executors to time (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    child = parser.add_argument_group("child process (started by this benchmark)")
    child.add_argument("--serve", type=int, metavar="PORT", help="only serve the null executor on PORT")
    child.add_argument("--max-model-len", type=int, default=4096, help=argparse.SUPPRESS)
    child.add_argument("--num-blocks", type=int, default=1024, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.serve is not None:
        serve_null(args.serve, args.max_model_len, args.num_blocks)
        return {}
    num_steps = args.num_scheduler_steps
    if num_steps < 1:
        raise SystemExit(f"--num-scheduler-steps must be >= 1, got {num_steps}")
    max_model_len, num_blocks = geometry(max(args.batch), args.context, args.warmup + args.steps, num_steps)
    port = free_port()
    peers = [p for p in PEERS if p in args.peers]
    sizes = ({b: decode_sizes(b, args.context, args.steps, max_model_len, num_blocks, num_steps)
              for b in args.batch} if "floor" in peers else {})
    with null_server(port, max_model_len, num_blocks) as server:
        target = f"{HOST}:{port}"
        server.wait_serving(target, timeout_s=60)
        remote, streamed = RemoteExecutor(target), RemoteExecutor(target)
        floor = grpc.insecure_channel(target, EXECUTOR_CHANNEL_OPTIONS)
        executors = {"grpc": remote, "stream": OneAtATimeOverStream(streamed), "overlap": streamed,
                     "in-process": in_process_null(max_model_len, num_blocks)}
        runs = [(peer, batch) for batch in args.batch for peer in peers]
        timed: dict[tuple[str, int], list[Phases]] = {run: [] for run in runs}
        # Peers alternate within each repeat, so load drift on a shared machine hits them alike.
        with progress(total=len(runs) * args.repeats, desc="W4 decode runs") as bar:
            for _ in range(args.repeats):
                for peer, batch in runs:
                    timed[peer, batch].append(
                        time_floor(floor, sizes[batch], args.warmup, args.steps, num_steps) if peer == "floor" else
                        time_decode(executors[peer], batch, args.context, args.warmup, args.steps,
                                    overlap=peer == "overlap", num_steps=num_steps))
                    bar.update()
        results = {run: Phases.median(runs_of) for run, runs_of in timed.items()}
        remote.close()
        streamed.close()
        floor.close()
    print(f"W4: decode steps of context {args.context}, null executor, {num_steps} decode step(s) per plan, "
          f"median of {args.repeats} runs of {args.steps} steps (us per decode step)")
    rows = []
    for (peer, batch), p in results.items():
        baseline = results.get(("in-process", batch))
        total = per_step_us(peer, p)
        rows.append([batch, peer, p.schedule_us + p.plan_us, p.plan_us, p.execute_us, p.postprocess_us, total,
                     1e6 / p.wall_us, total / baseline.total_us if baseline else "-", p.cpu_us])
    print_table(["batch", "executor", "schedule+plan", "(plan)", "execute/RPC", "postprocess", "total",
                 "steps/s", "x in-process", "CPU"], rows)
    figures = figures_of(results, args.context, args.steps, args.repeats)
    figures["num_scheduler_steps"] = num_steps
    for batch, (plan_bytes, result_bytes) in sizes.items():
        figures[f"floor_plan_bytes_b{batch}"], figures[f"floor_result_bytes_b{batch}"] = plan_bytes, result_bytes
    write_json(args.json, figures)
    return figures


def per_step_us(peer: str, p: Phases) -> float:
    """The W4 figure of a peer: its phases' sum, or the wall time per step where the phases overlap."""
    return p.wall_us if peer == "overlap" else p.total_us


def figures_of(results: dict[tuple[str, int], Phases], context: int, steps: int, repeats: int) -> dict[str, float]:
    """The unprefixed keys are the unary gRPC path (the W4 figure); ``stream_``, ``overlap_``, ``inprocess_``
    and ``floor_`` are the peers."""
    figures: dict[str, float] = {"context": context, "steps": steps, "repeats": repeats}
    for (peer, batch), p in results.items():
        prefix = "" if peer == "grpc" else peer.replace("-", "") + "_"
        figures[f"{prefix}us_per_step_b{batch}"] = per_step_us(peer, p)
        figures[f"{prefix}steps_per_s_b{batch}"] = 1e6 / p.wall_us
        figures[f"{prefix}schedule_us_b{batch}"] = p.schedule_us + p.plan_us
        figures[f"{prefix}plan_us_b{batch}"] = p.plan_us
        figures[f"{prefix}{'execute' if peer == 'in-process' else 'rpc'}_us_b{batch}"] = p.execute_us
        figures[f"{prefix}postprocess_us_b{batch}"] = p.postprocess_us
        figures[f"{prefix}cpu_us_b{batch}"] = p.cpu_us
        if ("in-process", batch) in results and peer != "in-process":
            baseline = results["in-process", batch].total_us
            figures[f"{prefix or 'grpc_'}over_inprocess_b{batch}"] = per_step_us(peer, p) / baseline
    return figures


if __name__ == "__main__":
    main()
