"""W5: the split behind a simulated accelerator, or how long a GPU would wait for the CPU each step.

The executor is ``executor_svc.fakes.simulated``: a real executor on the real protocol that does every per-step CPU cost
of the model executor (apply the plan to its request table, pack the input tensors and attention metadata with
``model_input.prepare_input``, record the sampled tokens, build the result, which gRPC then serialises) but
replaces the forward pass and the sampling with ``--step-ms`` on a simulated device: a step is launched without
waiting, and waited for with the GIL released, as a CUDA synchronize does. Efficiency = step_ms x decode steps per
second: 1.0 when the accelerator never waits. Peers: ``split``, the Engine at nanoserve-scheduler's default flags
(``ServiceConfig()``: overlap on over the executor's StepStream, up to 8 decode steps per plan with the plans
pipelined, or ``--num-scheduler-steps``) driving the executor in a child process through ``RemoteExecutor``;
``in-process``, the same Engine configuration driving the same executor object directly (both Engines in this
process, at the GIL switch interval the scheduler service sets beside an accelerator); ``api``, the split as
deployed: the scheduler service at its default flags in front of the same executor (both child processes), with
``--batch`` clients streaming through the public API (``bench.overlap_api``); ``api_vllm``, the same with the clients
streaming the gateways' ``VllmEngine/Generate``, as a gateway in front of the scheduler does; ``api_http``, the same
with the clients streaming the OpenAI API's ``/v1/completions``; ``api_remote`` (run when named), ``api`` with the
clients' threads in SCHED_IDLE, so that they take only the CPU the server leaves, as clients on other machines
would take none (on a machine of few cores the clients of ``api`` take a share a deployment's server never gives
them); ``floor``, the same
clients streaming from ``bench.stream_floor``, gRPC Python sending one token per stream per step and nothing else:
what any one Python process pays to serve the streams.
Each batch prefills its sequences first (untimed), then times ``--steps`` decode steps of ``--batch`` sequences of
context ``--context`` after ``--warmup`` more.

Where the time goes, per decode step (means; medians of ``--repeats`` runs): the scheduler thread's schedule +
plan, postprocess, its wait for the result and its CPU time, and (in-process, where the executor can be timed) how
long the accelerator sat idle between two steps (its step N+1 is launched as soon as N's tokens are back, before
they are recorded and N's result is built and handed over) and the executor's ``prepare`` half (apply the plan,
pack the input), which runs while the step before is on the device. For ``api`` and ``floor`` the scheduler's CPU is
its whole process's and its API process's (the streams and gRPC included), the clients' is shown beside it, and so is
the scheduler's process alone (where the engine loop holds the GIL: a core at most);
``NANOSERVE_API_PROCESS=off`` in the environment runs ``api`` without the API process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from bench.common import HOST, Child, free_port, print_table, progress, write_json
from bench.overhead import geometry
from bench.overlap_api import TAIL_FACTOR, ApiPeer, ApiRun
from common.executor import Executor
from common.heap import freeze_startup_heap
from common.step import ExecutorInfo, StepPlan
from executor_svc.core.request_table import ScheduledChunk
from executor_svc.core.step_pipeline import PreparedStep
from executor_svc.fakes.simulated import Launched, SimulatedExecutor, simulated_executor
from executor_svc.fakes.simulated import parse_args as simulated_args
from executor_svc.runtime.model_input import ModelInput
from scheduler_svc.api.grpc_service import connect_engine, executor_client, set_gil_switch_interval
from scheduler_svc.config import ServiceConfig
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import Sequence as SchedulerSequence
from scheduler_svc.engine.checks import serving_overlap
from scheduler_svc.engine.engine import Engine

BLOCK_SIZE = 16
VOCAB_SIZE = 32000
PEERS = ("split", "in-process", "api", "api_vllm", "api_http", "api_remote", "floor")
# Peers timed through the public API, from clients in this process.
API_PEERS = ("api", "api_vllm", "api_http", "api_remote", "floor")
# Run when named: the diagnosis of the others, not a target.
DEFAULT_PEERS = tuple(p for p in PEERS if p != "api_remote")
# What nanoserve-scheduler runs with when given no flags.
DEFAULTS = ServiceConfig()


@dataclass
class Phases:
    """Microseconds per decode step: wall (what efficiency is made of), the scheduler thread's phases and CPU
    (api and floor: the whole serving process's CPU, and no phases), (in-process only) the accelerator's idle
    time between two steps and the executor's prepare half (apply + pack, which runs while the step before is on
    the device), and (api and floor) the streaming clients' CPU."""

    wall_us: float
    schedule_us: float
    postprocess_us: float
    wait_us: float
    cpu_us: float
    idle_us: float = 0.0
    prepare_us: float = 0.0
    client_cpu_us: float = 0.0
    own_cpu_us: float = 0.0
    tokens_per_message: float = 0.0
    gap_p50_ms: float = 0.0
    gap_p99_ms: float = 0.0

    @staticmethod
    def of_api(run: ApiRun) -> Phases:
        per_step = 1e6 / run.steps
        return Phases(run.wall_s * per_step, 0.0, 0.0, 0.0, run.scheduler_cpu_s * per_step,
                      client_cpu_us=run.client_cpu_s * per_step, own_cpu_us=run.own_cpu_s * per_step,
                      tokens_per_message=run.tokens_per_message, gap_p50_ms=run.gap_p50_ms,
                      gap_p99_ms=run.gap_p99_ms)

    @staticmethod
    def median(runs: list[Phases]) -> Phases:
        return Phases(*(statistics.median(getattr(r, f) for r in runs) for f in Phases.__dataclass_fields__))


class TimedSimulated(SimulatedExecutor):
    """The simulated executor noting how long its accelerator sat idle before each step (from the end of the step
    before to this one's launch) and how long each decode plan took to ``prepare``."""

    def __init__(self, info: ExecutorInfo, step_ms: float) -> None:
        super().__init__(info, step_ms)
        self.idle_s: list[float] = []
        self.prepare_s: list[float] = []
        self._free_at: float | None = None

    def prepare(self, plan: StepPlan) -> PreparedStep:
        t0 = time.perf_counter()
        prepared = super().prepare(plan)
        if not plan.is_prefill:
            self.prepare_s.append(time.perf_counter() - t0)
        return prepared

    def launch(self, chunks: list[ScheduledChunk], inputs: ModelInput | None = None,
               sampled_before: list[int] | None = None, behind: Launched | None = None) -> Launched:
        launched = super().launch(chunks, inputs, sampled_before, behind)
        if self._free_at is not None:
            self.idle_s.append(max(0.0, launched.done_at - self.step_s - self._free_at))
        self._free_at = launched.done_at
        return launched

    def clear(self) -> None:
        self.idle_s.clear()
        self.prepare_s.clear()

    def mean_us(self) -> tuple[float, float]:
        """Mean microseconds of accelerator idle per launch and of prepare per decode plan, since ``clear``."""
        return 1e6 * statistics.fmean(self.idle_s), 1e6 * statistics.fmean(self.prepare_s)


def time_decode(executor: Executor, config: ServiceConfig, batch: int, context: int, warmup: int,
                steps: int) -> Phases:
    """Prefill ``batch`` prompts of ``context`` tokens, then time ``steps`` decode steps after ``warmup``, with the
    Engine the scheduler service builds from ``config``."""
    engine: Engine = connect_engine(executor, config)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=engine.info.max_model_len - context, ignore_eos=True)
    seqs = [engine.add_request([rng.randrange(VOCAB_SIZE) for _ in range(context)], params) for _ in range(batch)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
    decoded = 0
    while decoded < warmup:
        decoded += decode_steps(engine, seqs[0])
    if isinstance(executor, TimedSimulated):
        executor.clear()
    sums = [0.0] * 3
    c0, t0 = time.thread_time(), time.perf_counter()
    decoded = 0
    while decoded < steps:
        decoded += decode_steps(engine, seqs[0])
        t = engine.last_timings
        for i, v in enumerate((t.schedule_s + t.plan_s, t.postprocess_s, t.execute_s)):
            sums[i] += v
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    steps = decoded
    assert engine.scheduler.num_preemptions == 0, "a sequence was preempted"
    for seq in seqs:
        engine.abort(seq)
    while engine.has_unfinished():
        engine.step()
    engine.step()
    idle = executor.mean_us() if isinstance(executor, TimedSimulated) else (0.0, 0.0)
    return Phases(*(1e6 * v / steps for v in (wall, *sums, cpu)), *idle)


def decode_steps(engine: Engine, seq: SchedulerSequence) -> int:
    """One engine step; how many decode steps it settled (a plan may hold several: every sequence runs the same
    number, so ``seq``'s tokens count them)."""
    return sum(len(out.token_ids) for out in engine.step() if out.seq is seq)


def executor_flags(step_ms: float, max_model_len: int, num_blocks: int) -> list[str]:
    """The child's flags, also used to build the in-process peer: both are the same executor."""
    return ["--step-ms", str(step_ms), "--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE),
            "--vocab-size", str(VOCAB_SIZE), "--max-model-len", str(max_model_len)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=5.0, help="milliseconds the simulated accelerator takes "
                        "per forward pass + sampling (the doc reports 2, 5 and 10; default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256],
                        help="running sequences per decode step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence when timing starts "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed decode steps first (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch and peer; medians are reported "
                        "(default: %(default)s)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(DEFAULT_PEERS),
                        help="executors to time (default: %(default)s)")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="the split and in-process peers' most decode steps per plan (default: the scheduler's "
                        f"own, {DEFAULTS.num_scheduler_steps})")
    parser.add_argument("--stream-interval", type=int, default=DEFAULTS.stream_interval,
                        help="the api peer's scheduler --stream-interval (default: its own, %(default)s)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.step_ms <= 0:
        parser.error(f"--step-ms must be > 0, got {args.step_ms}")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if max(args.batch) > DEFAULTS.max_num_seqs:
        parser.error(f"--batch is at most the default --max-num-seqs, {DEFAULTS.max_num_seqs}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    # The api peer's streams run past the timed window (TAIL_FACTOR): every executor gets room for them.
    max_model_len, num_blocks = geometry(max(args.batch), args.context,
                                         args.warmup + args.steps * (1 + TAIL_FACTOR), 1)
    flags = executor_flags(args.step_ms, max_model_len, num_blocks)
    port = free_port()
    peers = [p for p in PEERS if p in args.peers]
    argv = [sys.executable, "-m", "executor_svc.fakes.simulated", "--host", HOST, "--port", str(port), *flags]
    with Child("simulated executor", argv) as child:
        target = f"{HOST}:{port}"
        child.wait_serving(target, timeout_s=60)
        config = replace(DEFAULTS, executor=target,
                         num_scheduler_steps=args.num_scheduler_steps or DEFAULTS.num_scheduler_steps)
        remote = executor_client(config)
        in_process = simulated_executor(simulated_args(flags), TimedSimulated)
        apis: dict[str, ApiPeer] = {}
        runs = [(peer, batch) for batch in args.batch for peer in peers]
        timed: dict[tuple[str, int], list[Phases]] = {run: [] for run in runs}
        try:
            start = {"api": lambda: ApiPeer.scheduler(flags, args.stream_interval),
                     "api_vllm": lambda: ApiPeer.scheduler(flags, args.stream_interval, protocol="vllm"),
                     "api_http": lambda: ApiPeer.scheduler(flags, args.stream_interval, protocol="http"),
                     "api_remote": lambda: ApiPeer.scheduler(flags, args.stream_interval, remote_clients=True),
                     "floor": lambda: ApiPeer.floor(args.step_ms)}
            for peer in API_PEERS:
                if peer in peers:
                    apis[peer] = start[peer]()
            decode = {
                "split": lambda batch: time_decode(remote, config, batch, args.context, args.warmup, args.steps),
                "in-process": lambda batch: time_decode(in_process, config, batch, args.context, args.warmup,
                                                        args.steps),
                **{peer: partial(time_api_decode, api, args) for peer, api in apis.items()},
            }
            freeze_startup_heap()  # as both services do once built
            set_gil_switch_interval(in_process.info)  # as the scheduler service does beside this device
            # Peers alternate within each repeat, so load drift on a shared machine hits them alike.
            with progress(total=len(runs) * args.repeats, desc="W5 decode runs") as bar:
                for _ in range(args.repeats):
                    for peer, batch in runs:
                        timed[peer, batch].append(decode[peer](batch))
                        bar.update()
        finally:
            remote.close()
            for api in apis.values():
                api.close()
    results = {run: Phases.median(runs_of) for run, runs_of in timed.items()}
    overlap = "on" if serving_overlap(DEFAULTS.overlap, on_cpu=False) else "off"
    print(f"W5: decode steps of context {args.context}, simulated accelerator of {args.step_ms:g} ms per step, "
          f"scheduler at its default flags (overlap {overlap}), median of "
          f"{args.repeats} runs of {args.steps} steps (us per decode step)")
    rows = []
    for (peer, batch), p in results.items():
        phases = ["-"] * 3 if peer in API_PEERS else [p.schedule_us, p.postprocess_us, p.wait_us]
        executor = [p.idle_us, p.prepare_us] if peer == "in-process" else ["-", "-"]
        rows.append([batch, peer, efficiency(args.step_ms, p), 1e6 / p.wall_us, p.wall_us, *phases, p.cpu_us,
                     *executor, *([p.client_cpu_us, p.own_cpu_us, p.tokens_per_message,
                                   f"{p.gap_p50_ms:.1f} / {p.gap_p99_ms:.1f}"] if peer in API_PEERS else ["-"] * 4)])
    print_table(["batch", "executor", "efficiency", "steps/s", "wall", "schedule+plan", "postprocess",
                 "wait for result", "scheduler CPU", "accelerator idle", "prepare (beside)", "clients' CPU",
                 "scheduler process alone", "tokens a message", "message gap p50 / p99 ms"], rows)
    figures = figures_of(results, args)
    write_json(args.json, figures)
    return figures


def time_api_decode(api: ApiPeer, args: argparse.Namespace, batch: int) -> Phases:
    return Phases.of_api(api.time_decode(batch, args.context, args.warmup, args.steps, VOCAB_SIZE))


def efficiency(step_ms: float, p: Phases) -> float:
    """step_ms x decode steps per second: the share of the wall time the accelerator is busy."""
    return 1e3 * step_ms / p.wall_us


def figures_of(results: dict[tuple[str, int], Phases], args: argparse.Namespace) -> dict[str, float]:
    figures: dict[str, float] = {"step_ms": args.step_ms, "context": args.context, "steps": args.steps,
                                 "repeats": args.repeats, "stream_interval": args.stream_interval}
    for (peer, batch), p in results.items():
        prefix = peer.replace("-", "")
        figures[f"{prefix}_efficiency_b{batch}"] = efficiency(args.step_ms, p)
        figures[f"{prefix}_steps_per_s_b{batch}"] = 1e6 / p.wall_us
        figures[f"{prefix}_cpu_us_b{batch}"] = p.cpu_us
        if peer in API_PEERS:
            figures[f"{prefix}_client_cpu_us_b{batch}"] = p.client_cpu_us
            figures[f"{prefix}_own_cpu_us_b{batch}"] = p.own_cpu_us
            figures[f"{prefix}_tokens_per_message_b{batch}"] = p.tokens_per_message
            figures[f"{prefix}_gap_p50_ms_b{batch}"] = p.gap_p50_ms
            figures[f"{prefix}_gap_p99_ms_b{batch}"] = p.gap_p99_ms
            continue
        figures[f"{prefix}_schedule_us_b{batch}"] = p.schedule_us
        figures[f"{prefix}_postprocess_us_b{batch}"] = p.postprocess_us
        figures[f"{prefix}_wait_us_b{batch}"] = p.wait_us
        if peer == "in-process":
            figures[f"inprocess_idle_us_b{batch}"] = p.idle_us
            figures[f"inprocess_prepare_us_b{batch}"] = p.prepare_us
    return figures


if __name__ == "__main__":
    main()
