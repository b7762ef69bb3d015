"""What recording costs (docs/replay.md): W1 and W5 with and without the scheduler's ``--record``, in one invocation.

Peers, each timed plain and recorded in turn (the order reversed every other round, so that the machine's drift
weighs on both alike):

- ``w1``: ``bench.throughput``'s ``split`` peer, the executor and the scheduler as two processes at default flags,
  every W1 request sent at once through the public API; tokens per second. Recorded: the scheduler with
  ``--record DIR``.
- ``w5``: ``bench.overlap``'s ``split`` peer, the Engine at the scheduler's default flags driving the simulated
  accelerator over gRPC; decode steps per second at ``--batch``. Recorded: through ``RecordingExecutor``, as the
  scheduler service records.
- ``w5-api``: ``bench.overlap``'s ``api`` peer, the scheduler service streaming to ``--batch`` clients; recorded:
  with ``--record DIR``.

Each peer's ratio is the median over rounds of recorded / plain in the same round (target: >= 0.98). On shared
cores a round's noise can pass the 2 % asked, so beside it is what recording adds to the scheduler process, which
no noise moves: the writer thread's CPU over a whole recorded run (its recording encoded, framed and written again,
as the writer did), as a share of the run's wall time on one core; ``encode``, that CPU per plan and result of a
decode step at ``--batch``; and what the step's own path pays (a plan submitted and its result called back, each
handed to the writer's queue), against an executor that answers at once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.common import HOST, WORKLOADS, Child, free_port, print_table, write_json
from bench.overhead import geometry
from bench.overlap import DEFAULTS, TAIL_FACTOR, VOCAB_SIZE, executor_flags, time_decode
from bench.overlap_api import ApiPeer
from common.executor import Executor
from common.recording import Recording, RecordingWriter, record_bytes
from common.step import CachedRequests, ExecutorInfo, StepPlan, StepResult
from common.step_codec import info_from_proto, plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from scheduler_svc.api.grpc_service import executor_client
from scheduler_svc.engine.recorder import Recorder
from scheduler_svc.engine.recording_executor import RecordingExecutor

PEERS = ("w1", "w5", "w5-api")
DECODERS = {"plan": plan_from_proto, "result": result_from_proto, "handshake": info_from_proto}
# Records the writer takes at a time (about 50 ms of decode steps).
WRITER_BATCH = 32


def encode_us(batch: int, directory: Path, repeats: int = 2000) -> float:
    """Microseconds of the writer's work for one decode step of ``batch`` sequences: its plan and its result."""
    plan = StepPlan(7, False, [], [], CachedRequests(list(range(batch)), [512] * batch, [1] * batch, [0] * batch, []))
    result = StepResult(list(range(batch)), instance_id="x" * 32, step_id=7)
    writer = RecordingWriter(directory, "encode", 0.0, False, 256 << 20)
    start = time.thread_time()
    for _ in range(repeats):
        writer.write([record_bytes("plan", 1.0, plan_to_proto(plan).SerializeToString()),
                      record_bytes("result", 1.0, result_to_proto(result).SerializeToString())])
    writer.close()
    return 1e6 * (time.thread_time() - start) / repeats


class Answered(Executor):
    """Answers each plan at once with a ready result: what is left to time is the caller's own path."""

    def __init__(self, result: StepResult) -> None:
        self.result = result

    def get_info(self) -> ExecutorInfo:
        return ExecutorInfo(instance_id="x")

    def step(self, plan: StepPlan) -> StepResult:
        return self.result

    def reset(self) -> int:
        return 0


def step_path_us(batch: int, directory: Path, repeats: int = 1500) -> float:
    """Microseconds the recording adds to a step's own path (a plan submitted, its result called back), against
    the same executor unrecorded; the writer thread's work is not in it (``encode_us``). Few enough repeats that
    the writer's queue holds them all even if it does not wake meanwhile."""
    plan = StepPlan(7, False, [], [], CachedRequests(list(range(batch)), [512] * batch, [1] * batch, [0] * batch, []))
    inner = Answered(StepResult(list(range(batch)), instance_id="x", step_id=7))
    recorder = Recorder(directory)
    recorder.start()
    recorded = RecordingExecutor(inner, recorder)
    recorded.reset()
    timings = []
    for executor in (inner, recorded, inner, recorded):
        start = time.perf_counter()
        for _ in range(repeats):
            executor.submit(plan).result()
        timings.append((time.perf_counter() - start) / repeats)
    recorder.stop()
    return 1e6 * (min(timings[1::2]) - min(timings[::2]))


def writer_cpu_s(directory: Path) -> tuple[float, int]:
    """CPU seconds of the writer thread's work for the recording in ``directory``, done again (encode, frame, write
    into a scratch copy, in batches as the writer takes them), and the number of records."""
    recording, items = Recording(directory), []
    for session in recording.sessions:
        for record in recording.records(session):
            entry = record.WhichOneof("entry")
            decode = DECODERS.get(entry)
            items.append((entry, decode(getattr(record, entry)) if decode else getattr(record, entry)))
    recorder = Recorder(directory / "again")
    writer = RecordingWriter(directory / "again", "again", 0.0, False, 256 << 20)
    start = time.thread_time()
    for i in range(0, len(items), WRITER_BATCH):
        batch = items[i : i + WRITER_BATCH]
        writer.write([record_bytes(entry, 1.0, recorder.encode(entry, item)) for entry, item in batch])
    writer.close()
    return time.thread_time() - start, len(items)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.record_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of plain and recorded (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=None, help="w1: only the first N requests")
    parser.add_argument("--threads", type=int, default=2, help="w1: torch threads (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="w1's dtype")
    parser.add_argument("--step-ms", type=float, default=5.0, help="w5: the simulated step (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=256, help="w5: sequences decoding (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="w5: tokens per sequence (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="w5: timed decode steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="w5: untimed decode steps first")
    parser.add_argument("--directory", type=Path, default=None,
                        help="where recordings go (default: a temporary directory; the disk's speed counts)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    return parser.parse_args(argv)


def w1_args(args: argparse.Namespace) -> argparse.Namespace:
    """``bench.throughput``'s arguments for its split peer at W1's settings."""
    from bench.throughput import parse_args as throughput_args

    return throughput_args(["--threads", str(args.threads), "--dtype", args.dtype, "--peers", "split"])


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    root = args.directory or Path(tempfile.mkdtemp(prefix="nanoserve-recording-"))
    root.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[tuple[float, float]]] = {peer: [] for peer in args.peers}
    # Each recorded run's directory and wall seconds, by peer.
    recorded_runs: dict[str, list[tuple[Path, float]]] = {peer: [] for peer in args.peers}
    sessions = iter(range(1_000_000))

    def new_directory() -> Path:
        return root / f"run-{next(sessions)}"

    def record_flags(directory: Path | None) -> tuple[str, ...]:
        return ("--record", str(directory)) if directory is not None else ()

    timers = {}
    if "w1" in args.peers:
        from bench.throughput import run_split

        workload, throughput = WORKLOADS["w1"]().head(args.num_requests), w1_args(args)
        tokens = sum(workload.max_tokens)

        def w1(directory: Path | None) -> tuple[float, float]:
            seconds = run_split(throughput, workload, True, scheduler_flags=record_flags(directory))
            return tokens / seconds, seconds

        timers["w1"] = w1
    max_model_len, num_blocks = geometry(args.batch, args.context, args.warmup + args.steps * (1 + TAIL_FACTOR), 1)
    flags = executor_flags(args.step_ms, max_model_len, num_blocks)
    with Child("simulated executor", simulated_argv(port := free_port(), flags)) as child:
        child.wait_serving(f"{HOST}:{port}", timeout_s=60)
        config = replace(DEFAULTS, executor=f"{HOST}:{port}")
        if "w5" in args.peers:
            def w5(directory: Path | None) -> tuple[float, float]:
                # A channel of its own each run: one left idle through the other peers' minutes would be closed by
                # the executor's gRPC server for its keepalive pings ("too many pings").
                executor = remote = executor_client(config)
                if directory is not None:
                    recorder = Recorder(directory)
                    recorder.start()
                    executor = RecordingExecutor(remote, recorder)
                start = time.perf_counter()
                try:
                    steps_per_s = 1e6 / time_decode(executor, config, args.batch, args.context, args.warmup,
                                                    args.steps).wall_us
                    return steps_per_s, time.perf_counter() - start
                finally:
                    if directory is not None:
                        recorder.stop()
                    remote.close()

            timers["w5"] = w5
        if "w5-api" in args.peers:
            def w5_api(directory: Path | None) -> tuple[float, float]:
                api = ApiPeer.scheduler(flags, scheduler_flags=record_flags(directory))
                start = time.perf_counter()
                try:
                    run = api.time_decode(args.batch, args.context, args.warmup, args.steps, VOCAB_SIZE)
                    return run.steps / run.wall_s, time.perf_counter() - start
                finally:
                    api.close()  # stopped: its recording ends, whole

            timers["w5-api"] = w5_api
        for round_ in range(args.repeats):
            for peer in args.peers:
                order = (False, True) if round_ % 2 == 0 else (True, False)
                figures = {}
                for recorded in order:
                    directory = new_directory() if recorded else None
                    figures[recorded], seconds = timers[peer](directory)
                    if directory is not None:
                        recorded_runs[peer].append((directory, seconds))
                rounds[peer].append((figures[False], figures[True]))
                print(f"round {round_ + 1} {peer}: plain {figures[False]:.1f}, recorded {figures[True]:.1f}",
                      file=sys.stderr, flush=True)
    encode, path = encode_us(args.batch, root / "encode"), step_path_us(args.batch, root / "path")
    results: dict[str, float] = {"encode_us_per_step": encode, "step_path_us": path, "batch": args.batch,
                                 "repeats": args.repeats}
    rows = []
    for peer, pairs in rounds.items():
        plain, recorded = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        ratio = statistics.median(r / p for p, r in pairs)
        directory, seconds = recorded_runs[peer][-1]
        cpu_s, num_records = writer_cpu_s(directory)
        share = cpu_s / seconds
        rows.append([peer, plain, recorded, ratio, " ".join(f"{r / p:.3f}" for p, r in pairs), num_records,
                     1e3 * cpu_s, 100 * share])
        results |= {f"{peer}_plain": plain, f"{peer}_recorded": recorded, f"{peer}_ratio": ratio,
                    f"{peer}_writer_cpu_share": share, f"{peer}_records": num_records}
    print("recording overhead (w1: tokens/s; w5, w5-api: decode steps/s at batch "
          f"{args.batch}, {args.step_ms:g} ms steps); ratio = recorded / plain, paired per round")
    print_table(["peer", "plain", "recorded", "ratio (median)", "rounds", "records (last run)",
                 "writer CPU (ms)", "writer CPU (% of the run)"], rows)
    print(f"writer thread: {encode:.0f} us of CPU per decode step of {args.batch} (plan and result); the step's "
          f"own path: {path:.1f} us more")
    write_json(args.json, results)
    return results


def simulated_argv(port: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "executor_svc.fakes.simulated", "--host", HOST, "--port", str(port), *flags]


if __name__ == "__main__":
    main()
