"""W3: online serving latency with Poisson arrivals, every request streamed, EOS ignored.

Peers in turn (the default): each server of ``--peers`` is started, warmed up (``warm_up``), driven at every
``--request-rate`` with the same arrivals (a seeded draw, scaled to come at that rate) and prompts (a draw of their own
for each rate, so no rate finds the one before it in the prefix cache), and stopped before the next starts; ``--rounds
N`` repeats this, every other round in reverse order, and each figure is the median of its rounds. ``nanoserve`` is the
stack ``make run`` starts (``python -m client.stack``, default flags, ``--dtype`` passed through) driven over gRPC,
``nanoserve_openai`` the same stack over its OpenAI endpoint, ``nanoserve_mixed`` (not run unless named) the stack at
``--scheduling-policy mixed`` over gRPC, ``vllm`` vLLM's CPU build (``vllm serve``, its best settings on these cores;
the python of its environment from ``--vllm-python`` or NANOSERVE_VLLM_PYTHON, else it is skipped with a line saying
why) over its OpenAI endpoint. The load comes from this package's client (``--client builtin``:
``client.api.AsyncClient`` for gRPC, the ``openai`` SDK for HTTP, prompts as token ids) or from ``vllm bench serve
--backend openai --dataset-name random --ignore-eos`` (``--client vllm-bench``; OpenAI peers only, its own random
prompts of the workload's shape), whose per-request figures are read back and summarised by the same code. With
``--device cuda`` the nanoserve peers are the pair as docker-compose.yml runs it on one GPU (``--model``, in bfloat16
unless ``--dtype`` says otherwise), each service started from this checkout; the vllm peer does not run there.

Figures, as vLLM's serving benchmark reports them: request and output-token throughput; TTFT, TPOT and ITL (every
gap between streamed chunks) at p50 / p90 / p99. A peer *kept up* with a rate when no request failed and it
completed requests at least 0.95x as fast as they arrived, both rates measured over their own span (requests - 1
over the time from the first send to the last, and from the first completion to the last), and requests did not
pile up (the mean in flight at the last quarter's arrivals at most the third quarter's plus a quarter of a quarter's
requests, plus 2: completions at three quarters of the arrivals' pace or faster); its
*saturation point*
is the highest rate it kept up with, counting up from the lowest rate and stopping at its first miss. JSON: per peer
P and rate R (``2``, ``0.5``, ``inf``): ``P_rR_req_s``, ``P_rR_output_tok_s``, ``P_rR_{ttft,tpot,itl,e2e}_{mean,p50,
p90,p99}_ms``, ``P_rR_offered_req_s``, ``P_rR_achieved_req_s``, ``P_rR_in_flight_q3`` / ``_q4``, ``P_rR_kept_up``, and
``P_saturation_req_s``.

A single run instead (the figures' flat keys, one rate): ``--server`` (a running scheduler, gRPC), ``--base-url``
(an OpenAI-compatible server; the key comes from OPENAI_API_KEY) or ``--launch shadow`` (the model-free shadow
executor) / ``--launch real`` (the embedded model on CPU), driven through ``--backend grpc`` or ``openai``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench import vllm_setup
from bench.common import WARMUP_PROMPT, WORKLOADS, Workload, print_table, write_json
from bench.serving_load import (
    IN_FLIGHT_GROWTH,
    IN_FLIGHT_SLACK,
    QUANTILES,
    RequestResult,
    grpc_backend,
    kept_up,
    openai_backend,
    run_load,
    saturation_point,
    summarise,
)
from bench.serving_peers import (
    DEFAULT_PEERS,
    GRPC_PEERS,
    PEERS,
    Server,
    default_dtype,
    launch,
    model_name,
    run_vllm_bench,
    start_nanoserve,
    start_nanoserve_pair,
    start_vllm,
)

CLIENTS = ("builtin", "vllm-bench")
METRICS = ("ttft", "tpot", "itl", "e2e")


# Requests of the workload a server runs untimed before its first measured rate.
WARMUP_REQUESTS = 16

def plot(path: Path, results: list[RequestResult], title: str) -> None:
    """Histograms of TTFT, TPOT and end-to-end latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.error is None]
    series = [
        ("TTFT (ms)", [1e3 * r.ttft_s for r in done if r.output_tokens]),
        ("TPOT (ms)", [1e3 * r.tpot_s for r in done if r.tpot_s is not None]),
        ("end-to-end latency (s)", [r.latency_s for r in done]),
    ]
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6))
    for ax, (label, values) in zip(axes, series, strict=True):
        ax.hist(values, bins=30)
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="+", choices=PEERS,
                        help=f"servers to run in turn (default: {' '.join(DEFAULT_PEERS)})")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every peer, every other round in reverse "
                        "order; each figure is the median of its rounds (default: %(default)s)")
    parser.add_argument("--client", choices=CLIENTS, default="builtin", help="the load generator: this package's "
                        "client, or vllm bench serve from the vLLM environment (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="every launched server's dtype (default: make run's on this CPU, "
                        f"{default_dtype()}; bfloat16 with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the nanoserve peers run: cpu, the stack make run starts; cuda, the pair as "
                        "docker-compose.yml runs it on one GPU, without the vllm peer (default: %(default)s)")
    parser.add_argument("--model", help="the model the nanoserve peers serve, a name or a Hugging Face folder "
                        "(default: $NANOSERVE_MODEL, else the embedded one)")
    parser.add_argument("--vllm-python", help="python of a vLLM CPU environment, for the vllm peer and --client "
                        f"vllm-bench (default: ${vllm_setup.ENV_VAR}; docs/benchmarks.md)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--server", metavar="HOST:PORT", help="a single run against a running scheduler (gRPC)")
    target.add_argument("--base-url", metavar="URL",
                        help="a single run against a running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--launch", choices=("shadow", "real"), help="a single run against an executor (shadow: "
                        "model-free; real: the embedded model on CPU) and a scheduler it starts")
    parser.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                        help="the API of a single run: gRPC Generate or OpenAI's /v1/completions (default: "
                        "%(default)s)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w3",
                        help="w3: 256-token random prompts, 128 tokens out; w1 / w2: those workloads' requests "
                        "(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, help="send only the first N requests of the workload")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival gaps (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="scheduler budget of --launch "
                        "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of --launch real (default: "
                        "%(default)s)")
    parser.add_argument("--launch-timeout", type=float, default=600.0,
                        help="seconds a launched server may take to serve (default: %(default)s)")
    parser.add_argument("--plot", type=Path, help="a single run: save latency histograms to this PNG (matplotlib)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if any(rate <= 0 for rate in args.request_rate):
        parser.error("--request-rate must be > 0")
    args.single = bool(args.server or args.base_url or args.launch)
    if args.single:
        if args.peers or args.client != "builtin" or args.rounds != 1 or len(args.request_rate) != 1:
            parser.error("--server, --base-url and --launch are a single run: one rate, no --peers, --rounds or "
                         "--client")
        if args.server and args.backend != "grpc" or args.base_url and args.backend != "openai":
            parser.error("--server goes with --backend grpc, --base-url with --backend openai")
    elif args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.client == "vllm-bench" and args.workload != "w3":
        parser.error("--client vllm-bench draws its own random prompts of W3's shape: --workload w3")
    if args.device == "cuda" and (args.single or args.client != "builtin"):
        parser.error("--device cuda runs --peers in turn with --client builtin")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else default_dtype())
    args.model = args.model or model_name()
    args.peers = list(dict.fromkeys(args.peers or DEFAULT_PEERS))
    return args


def single_run(args: argparse.Namespace, workload: Workload) -> dict[str, object]:
    """One rate against one server: the flat figures of ``summarise``."""
    rate = args.request_rate[0]
    with ExitStack() as stack:
        if args.launch:
            target, base_url = launch(args.launch, workload, stack, args.max_num_seqs, args.threads, args.dtype,
                                      args.launch_timeout)
        else:
            target, base_url = args.server, args.base_url
        backend = grpc_backend(target) if args.backend == "grpc" else openai_backend(base_url)
        results, duration = asyncio.run(run_load(backend, workload, rate, args.seed))
    figures = {"backend": args.backend, **summarise(results, duration, rate)}
    against = args.server or args.base_url or args.launch + " stack"
    print(f"W3 {workload.name}: {len(workload)} requests at {rate} req/s against {against} ({args.backend})")
    print_table(["metric", "value"], [
        ["completed / failed", f"{figures['completed']} / {figures['failed']}"],
        ["duration (s)", figures["duration_s"]],
        ["request throughput (req/s)", figures["request_throughput"]],
        ["output tokens/s", figures["output_tok_s"]],
        *([f"{name} p{q} (ms)", figures[f"{key}_p{q}_ms"]] for name, key in
          (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")) for q in QUANTILES),
    ])
    for error in sorted({r.error for r in results if r.error}):
        print(f"error: {error}", file=sys.stderr)
    if args.plot:
        plot(args.plot, results, f"W3 {workload.name}, {rate} req/s, {against}, {args.backend}")
    return figures


def admit(args: argparse.Namespace) -> tuple[list[str], vllm_setup.VllmEnv | None, dict[str, str]]:
    """The peers that can run, the vLLM environment where one is needed, and why each other peer was left out."""
    peers, skipped = list(args.peers), {}
    if args.device == "cuda" and "vllm" in peers:
        skipped["vllm"] = "vLLM's CPU build serves on the CPU, not --device cuda"
        print(f"vllm peer skipped: {skipped['vllm']}", file=sys.stderr, flush=True)
        peers.remove("vllm")
    if "vllm" not in peers and args.client != "vllm-bench":
        return peers, None, skipped
    found = vllm_setup.find(args.vllm_python)
    reason = found if isinstance(found, str) else None if found.cli else vllm_setup.CLI_FIX
    if args.client == "vllm-bench":
        if reason:
            raise SystemExit(f"--client vllm-bench cannot run: {reason}")
        for peer in set(peers) & set(GRPC_PEERS):
            skipped[peer] = "vllm bench serve drives OpenAI endpoints only (nanoserve_openai is this server)"
    if "vllm" in peers and reason:
        skipped["vllm"] = reason
    for peer, why in skipped.items():
        print(f"{peer} peer skipped: {why}", file=sys.stderr, flush=True)
    return [p for p in peers if p not in skipped], None if isinstance(found, str) else found, skipped


def run_peer(args: argparse.Namespace, peer: str, venv: vllm_setup.VllmEnv | None, workload: Workload,
             logs: Path) -> dict[float, dict[str, float | None]]:
    """Start ``peer``, warm it up, drive it at every rate in turn, stop it; the figures of each rate. ``logs``: the
    stem of its log files' names."""
    figures = {}
    with ExitStack() as stack:
        if peer == "vllm":
            server = start_vllm(stack, venv, args.dtype, logs.with_suffix(".log"), args.launch_timeout,
                                args.model)
        else:
            policy = "mixed" if peer == "nanoserve_mixed" else None
            start = start_nanoserve_pair if args.device == "cuda" else start_nanoserve
            server = start(stack, args.dtype, logs.with_suffix(".log"), args.launch_timeout, policy, args.model)
        asyncio.run(warm_up(peer, server, workload.redrawn(-1), max(args.request_rate), args.seed))
        for i, rate in enumerate(args.request_rate):
            # Each rate's own prompts: the same for every peer and round, in no rate's prefix cache before.
            prompts = workload if i == 0 else workload.redrawn(i)
            if args.client == "vllm-bench":
                result = logs.with_name(f"{logs.name}-vllm-bench-r{rate:g}.json")
                results, duration = run_vllm_bench(venv, server, prompts, rate, args.seed + i, result)
            else:
                backend = grpc_backend(server.grpc_target) if peer in GRPC_PEERS else openai_backend(server.base_url)
                results, duration = asyncio.run(run_load(backend, prompts, rate, args.seed, label=peer))
            figures[rate] = summarise(results, duration, rate)
            for error in sorted({r.error for r in results if r.error})[:3]:
                print(f"{peer} error: {error}", file=sys.stderr)
    return figures


async def warm_up(peer: str, server: Server, workload: Workload, rate: float, seed: int) -> None:
    """Untimed, through the API the peer is measured on: one short request, then the first ``WARMUP_REQUESTS`` of
    ``workload`` (a draw of its own, so no measured prompt is cached by it) at the run's highest rate, so that the
    first rate measured does not pay for what a server does once, its first batches of each shape
    (docs/benchmarks-history.md, W3 against vLLM's CPU build)."""
    def backend() -> contextlib.AbstractAsyncContextManager:
        return grpc_backend(server.grpc_target) if peer in GRPC_PEERS else openai_backend(server.base_url)

    async with backend() as send_one:
        result = await send_one(WARMUP_PROMPT, 4, 0.0)
    if result.error:
        raise RuntimeError(f"the {peer} warm-up request failed: {result.error}")
    results, _ = await run_load(backend(), workload.head(WARMUP_REQUESTS), rate, seed + 1, label=f"{peer} warm-up")
    failed = next((r.error for r in results if r.error), None)
    if failed:
        raise RuntimeError(f"the {peer} warm-up load failed: {failed}")


def medians(rounds: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure's median over rounds; ``kept_up`` judged again on the medians."""
    merged: dict[str, float | None] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if isinstance(r[key], int | float) and not isinstance(r[key], bool)]
        merged[key] = statistics.median(values) if values else None
    merged["failed"] = max(r["failed"] for r in rounds)
    in_flight = (merged["in_flight_q3"], merged["in_flight_q4"]) if merged.get("in_flight_q3") is not None else None
    merged["kept_up"] = kept_up(merged["offered_req_s"], merged["achieved_req_s"], merged["failed"], in_flight,
                                int(merged["completed"]) + int(merged["failed"]))
    return merged


def peer_keys(peer: str, rate: float, figures: dict[str, float | None]) -> dict[str, object]:
    """The JSON keys of one peer at one rate: ``P_rR_...``."""
    prefix = f"{peer}_r{rate:g}_"
    keys = {"req_s": figures["request_throughput"], "output_tok_s": figures["output_tok_s"],
            "offered_req_s": figures["offered_req_s"], "achieved_req_s": figures["achieved_req_s"],
            "kept_up": figures["kept_up"], "completed": figures["completed"], "failed": figures["failed"],
            "in_flight_q3": figures["in_flight_q3"], "in_flight_q4": figures["in_flight_q4"]}
    keys.update({f"{m}_{s}_ms": figures[f"{m}_{s}_ms"] for m in METRICS for s in ("mean", *(f"p{q}" for q in
                                                                                          QUANTILES))})
    return {prefix + key: value for key, value in keys.items()}


def in_flight_cell(figures: dict[str, float | None]) -> str:
    q3, q4 = figures["in_flight_q3"], figures["in_flight_q4"]
    return "-" if q3 is None or q4 is None else f"{q3:.1f}, {q4:.1f}"


def percentiles(figures: dict[str, float | None], metric: str) -> str:
    return " / ".join(f"{figures[f'{metric}_p{q}_ms']:.1f}" for q in QUANTILES)


def print_peers(workload: Workload, args: argparse.Namespace, table: dict[tuple[str, float], dict],
                saturation: dict[str, float | None]) -> None:
    print(f"W3 {workload.name}: {len(workload)} requests per rate, {args.model} on {args.device}, {args.dtype}, "
          f"client {args.client}, {args.rounds} round(s); TTFT / TPOT / ITL p50 / p90 / p99 in ms")
    rows = []
    for (peer, rate), f in table.items():
        vllm = table.get(("vllm", rate))
        rows.append([peer, f"{rate:g}", f["request_throughput"], f"{f['achieved_req_s'] or 0:.2f} / "
                     f"{f['offered_req_s'] or 0:.2f}", f["output_tok_s"],
                     f["output_tok_s"] / vllm["output_tok_s"] if vllm and vllm["output_tok_s"] else "-",
                     percentiles(f, "ttft"), percentiles(f, "tpot"), percentiles(f, "itl"), in_flight_cell(f),
                     {True: "yes", False: "no", None: "-"}[f["kept_up"]]])
    print_table(["peer", "req/s offered", "req/s", "achieved / offered", "output tok/s", "vs vllm", "TTFT", "TPOT",
                 "ITL", "in flight", "kept up"], rows)
    print(f"in flight: the mean at the third quarter's arrivals, then at the last's; kept up allows "
          f"+{IN_FLIGHT_GROWTH * len(workload) / 4 + IN_FLIGHT_SLACK:g}")
    for peer, rate in saturation.items():
        print(f"saturation point of {peer}: " + (f"{rate:g} req/s" if rate is not None else "none of these rates"))


def run_peers(args: argparse.Namespace, workload: Workload) -> dict[str, object]:
    """Every peer in turn, every rate, ``--rounds`` times; the medians' keys."""
    peers, venv, skipped = admit(args)
    if not peers:
        raise SystemExit("no peer left to run")
    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-w3-"))
    print(f"W3: servers' logs in {log_dir}", file=sys.stderr)
    runs: dict[tuple[str, float], list[dict[str, float | None]]] = defaultdict(list)
    for round_ in range(args.rounds):
        for peer in peers if round_ % 2 == 0 else peers[::-1]:
            for rate, figures in run_peer(args, peer, venv, workload, log_dir / f"round{round_ + 1}-{peer}").items():
                runs[peer, rate].append(figures)
                print(f"round {round_ + 1} {peer} @ {rate:g} req/s: {figures['request_throughput']:.2f} req/s, "
                      f"{figures['output_tok_s']:.1f} output tok/s, TTFT p50 {figures['ttft_p50_ms']:.1f} ms, "
                      f"kept up: {figures['kept_up']}", file=sys.stderr, flush=True)
    table = {(peer, rate): medians(runs[peer, rate]) for peer in peers for rate in args.request_rate}
    saturation = {peer: saturation_point({rate: table[peer, rate]["kept_up"] for rate in args.request_rate})
                  for peer in peers}
    print_peers(workload, args, table, saturation)
    out: dict[str, object] = {"workload": workload.name, "num_prompts": len(workload), "dtype": args.dtype,
                              "device": args.device, "model": args.model,
                              "client": args.client, "rounds": args.rounds, "peers": peers, "skipped": skipped,
                              "request_rates": [r if math.isfinite(r) else None for r in args.request_rate]}
    for (peer, rate), figures in table.items():
        out.update(peer_keys(peer, rate, figures))
    out.update({f"{peer}_saturation_req_s": rate for peer, rate in saturation.items()})
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    workload = WORKLOADS[args.workload]().head(args.num_prompts)
    figures = single_run(args, workload) if args.single else run_peers(args, workload)
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
