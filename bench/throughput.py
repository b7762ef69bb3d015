"""W1 (CPU) or W2 (GPU): offline throughput (BENCHMARKS.md), every peer in one invocation.

Peers generate the same requests (``ignore_eos``; W1 greedy, W2 at temperature 0.6) with the same weights, dtype and
threads; throughput is sum(max_tokens) / wall seconds of generation, after model load and one warm-up. With
``--repeats``, rounds alternate between peers (in reverse every other round) and a peer's figure is the median of
its rounds; beside it are each round's share of the machine's CPU time that the hypervisor stole, and ``paired
rounds``: the median over rounds of the peer's speed over the in-process peer's in the same round, which the
machine's drift between rounds does not move. ``hf`` is transformers with naive batching (batches of 16 in order,
left padding, every row of a batch generating the batch's largest max_tokens); ``hf_cb`` is transformers' own
continuous batching (``generate_batch``'s manager, paged KV cache; bench/hf_cb.py), every request at once with its
own max_tokens; ``inprocess`` is the scheduler Engine driving the ModelExecutor in this process
(``inprocess_layers``: the same with ``--cpu-decode-stack off``, decode steps layer by layer;
``inprocess_overlap``: the same with the Engine's overlap, one step in flight on a worker thread); ``split`` and
``split_overlap`` run the executor and the scheduler as two processes over gRPC (the latter with ``--overlap``) and
send every request at once through the public API with ``client.api.AsyncClient.generate`` (responses of
``JOINED_STREAM_INTERVAL`` tokens; ``split_tokens``: at default flags, one response per token, as a streaming reader
gets them at the server's default; ``split_whole``: at default flags, as whole completions through ``GenerateOnce``,
not streamed; ``split_yield``: at default flags but ``--yield-cpu on`` for both services); ``llamacpp`` (W1, when
llama-cpp-python is installed; see bench/llamacpp.py) is llama.cpp on a float32 / bfloat16 GGUF of the same weights,
64 slots batching continuously as llama-server does, prompt chunks and decodes in one ``llama_decode``; ``vllm`` (W1,
when ``--vllm-python`` or NANOSERVE_VLLM_PYTHON names a vLLM environment, else skipped with a line saying why; see
bench/vllm_setup.py) is vLLM's CPU build, one ``LLM.generate`` over every request at its best settings on these cores.
A peer is a function in ``PEERS``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from executor_svc.cpu.malloc import keep_heap_memory
from executor_svc.cpu.openmp import set_wait_policy

# Before torch loads OpenMP, for every peer alike: the executor's short spin (executor_svc/cpu/openmp.py),
# and its malloc thresholds (executor_svc/cpu/malloc.py).
set_wait_policy()
keep_heap_memory()

import torch  # noqa: E402

from bench import hf_cb, llamacpp, vllm_setup  # noqa: E402 - llamacpp imports llama_cpp only when its peer runs
from bench.common import (  # noqa: E402
    HOST,
    WARMUP_PROMPT,
    WORKLOADS,
    Child,
    StolenCpu,
    Workload,
    free_port,
    print_table,
    progress,
    write_json,
)
from executor_svc.__main__ import cpu_kernels_flag  # noqa: E402
from scheduler_svc.config import ServiceConfig  # noqa: E402
from scheduler_svc.core.scheduler import POLICY_NAMES  # noqa: E402

HF_BATCH_SIZE = 16
HF_PEERS = ("hf", "hf_cb")


def run_hf(args: argparse.Namespace, workload: Workload) -> float:
    """transformers ``generate`` over batches of 16 in order; seconds of generation."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from executor_svc.runtime.registry import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    pad_id = model.generation_config.pad_token_id or 0
    greedy = workload.temperature == 0
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": workload.temperature}

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=args.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=pad_id, **sampling,
            )

    generate([WARMUP_PROMPT], 4)
    start = time.perf_counter()
    with progress(total=sum(workload.max_tokens), desc="hf", unit="tok") as bar:
        for i in range(0, len(workload), HF_BATCH_SIZE):
            limits = workload.max_tokens[i : i + HF_BATCH_SIZE]
            generate(workload.prompts[i : i + HF_BATCH_SIZE], max(limits))
            bar.update(sum(limits))
    return time.perf_counter() - start


def run_inprocess(args: argparse.Namespace, workload: Workload, stack: bool = True, overlap: bool = False) -> float:
    """The scheduler Engine and the ModelExecutor in this process; seconds of generation. ``stack``: the executor's
    ``--cpu-decode-stack``; ``overlap``: the Engine keeps a step in flight on a worker thread, as the split's
    default flags do over gRPC."""
    from common.heap import freeze_startup_heap
    from executor_svc.runtime.config import ExecutorOptions
    from executor_svc.runtime.model_executor import ModelExecutor
    from scheduler_svc.api.grpc_service import set_gil_switch_interval
    from scheduler_svc.core.sampling import SamplingParams
    from scheduler_svc.core.scheduler import SchedulerConfig
    from scheduler_svc.engine.engine import Engine

    options = ExecutorOptions(
        model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=kv_cache_memory(args),
        threads=args.threads, device=args.device, max_model_len=workload.max_model_len, cpu_decode_stack=stack,
        cpu_kernels=args.cpu_kernels,
    )
    steps = args.num_scheduler_steps or ServiceConfig().num_scheduler_steps
    config = SchedulerConfig(num_scheduler_steps=steps, policy=args.scheduling_policy)
    engine = Engine(ModelExecutor(options), config, overlap=overlap)
    engine.generate([WARMUP_PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    freeze_startup_heap()  # as both services do once built
    interval = sys.getswitchinterval()
    set_gil_switch_interval(engine.info)  # as the scheduler service does beside an accelerator
    try:
        start = time.perf_counter()
        for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
            engine.add_request(
                prompt, SamplingParams(temperature=workload.temperature, max_tokens=max_tokens, ignore_eos=True)
            )
        with progress(total=sum(workload.max_tokens), desc="in-process" + (" overlap" if overlap else ""),
                      unit="tok") as bar:
            while engine.has_unfinished():
                # an output holds a step's tokens for one sequence: several under multi-step decode
                bar.update(sum(len(out.token_ids) for out in engine.step()))
        return time.perf_counter() - start
    finally:
        sys.setswitchinterval(interval)  # the peers after this one are clients


def run_split(args: argparse.Namespace, workload: Workload, overlap: bool, how: str = "generate",
              yield_cpu: bool = False, scheduler_flags: tuple[str, ...] = ()) -> float:
    """Executor and scheduler as subprocesses, every request sent at once through the public API: ``how`` is
    ``generate`` (``AsyncClient.generate``), ``tokens`` (the same, one response per token) or ``whole`` (whole
    completions through ``GenerateOnce``); ``yield_cpu`` is both services' ``--yield-cpu``; ``scheduler_flags``
    go to the scheduler last (bench.record_overhead's ``--record``)."""

    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-w1-"))
    executor_port, scheduler_port = free_port(), free_port()
    executor_argv = [
        sys.executable, "-m", "executor_svc", "--port", str(executor_port), "--model", args.model,
        "--device", args.device, "--dtype", args.dtype, "--block-size", str(args.block_size),
        "--threads", str(args.threads), "--max-model-len", str(workload.max_model_len),
        "--yield-cpu", str(yield_cpu).lower(),
    ]
    if args.cpu_kernels != "auto":  # else NANOSERVE_CPU_KERNELS, where set, still reaches the executor
        executor_argv += ["--cpu-kernels", args.cpu_kernels]
    if (kv_bytes := kv_cache_memory(args)) is not None:
        executor_argv += ["--kv-cache-memory", str(kv_bytes)]
    scheduler_argv = [
        sys.executable, "-m", "scheduler_svc", "--executor", f"{HOST}:{executor_port}", "--port", str(scheduler_port),
        "--overlap", str(overlap).lower(), "--log-level", "WARNING", "--http-port", "0",
        "--yield-cpu", str(yield_cpu).lower(),
    ]
    if args.num_scheduler_steps is not None:
        scheduler_argv += ["--num-scheduler-steps", str(args.num_scheduler_steps)]
    scheduler_argv += ["--scheduling-policy", args.scheduling_policy, *scheduler_flags]
    target = f"{HOST}:{scheduler_port}"
    with ExitStack() as stack:
        executor = stack.enter_context(Child("executor", executor_argv, log_dir / "executor.log"))
        executor.wait_serving(f"{HOST}:{executor_port}", timeout_s=600)
        scheduler = stack.enter_context(Child("scheduler", scheduler_argv, log_dir / "scheduler.log"))
        scheduler.wait_serving(target, timeout_s=60)
        name = ("split" + ("+overlap" if overlap else "") + ("" if how == "generate" else f" ({how})")
                + (" (yield)" if yield_cpu else ""))
        return asyncio.run(_drive(target, workload, name, how))


async def _drive(target: str, workload: Workload, name: str, how: str) -> float:
    from client.api import AsyncClient, Completion
    from client.request_builder import build_request

    async with AsyncClient(target) as client:

        async def generate(**options: object) -> Completion:
            if how == "whole":
                return Completion.from_proto(await client.stub.GenerateOnce(build_request(**options)))
            return await client.generate(**options, **({"stream_interval": 1} if how == "tokens" else {}))

        await generate(token_ids=WARMUP_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
        with progress(total=sum(workload.max_tokens), desc=name, unit="tok") as bar:

            async def one(prompt: list[int], max_tokens: int) -> None:
                completion = await generate(
                    token_ids=prompt, max_tokens=max_tokens, temperature=workload.temperature, ignore_eos=True
                )
                assert len(completion.token_ids) == max_tokens, "a W1 request ended early"
                bar.update(max_tokens)

            start = time.perf_counter()
            await asyncio.gather(*(one(p, m) for p, m in zip(workload.prompts, workload.max_tokens, strict=True)))
            return time.perf_counter() - start


def release_gpu_memory() -> None:
    """Hand a finished in-process peer's GPU memory back to the device: an executor started next sizes its KV
    cache from the memory free then, and torch's allocator would otherwise keep the peer's cached."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


PEERS: dict[str, Callable[[argparse.Namespace, Workload], float]] = {
    "hf": run_hf,
    "hf_cb": hf_cb.run_hf_cb,
    "inprocess": run_inprocess,
    "inprocess_layers": partial(run_inprocess, stack=False),
    "inprocess_overlap": partial(run_inprocess, overlap=True),
    "split": partial(run_split, overlap=False),
    "split_overlap": partial(run_split, overlap=True),
    "split_tokens": partial(run_split, overlap=True, how="tokens"),
    "split_whole": partial(run_split, overlap=True, how="whole"),
    "split_yield": partial(run_split, overlap=True, yield_cpu=True),
    "llamacpp": llamacpp.run_llamacpp,
    "vllm": vllm_setup.run_w1,
}


def kv_cache_memory(args: argparse.Namespace) -> int | None:
    """The flag, else W1's 2 GiB on the CPU; on CUDA None lets the executor take its share of free memory."""
    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    return 2 << 30 if args.device == "cpu" else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="w1", choices=("w1", "w2"), help="W1 (CPU, greedy) or W2 (GPU, T=0.6)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="embedded model name or local HF folder (W2: python -m bench.random_model FOLDER)")
    p.add_argument("--device", default="cpu", help="cpu (W1) or cuda (W2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2, help="torch threads (W1: 2)")
    p.add_argument("--num-requests", type=int, default=None, help="run only the first N requests")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers peers (hf, hf_cb)")
    p.add_argument("--peers", nargs="+", choices=list(PEERS), default=None,
                   help="peers to run, in order (default: all, llamacpp and vllm where they can run)")
    p.add_argument("--vllm-python", default=None, help="python of a vLLM CPU environment for the vllm peer "
                   f"(default: ${vllm_setup.ENV_VAR}; without one the peer is skipped; docs/benchmarks.md)")
    p.add_argument("--cpu-kernels", type=cpu_kernels_flag, default="auto",
                   help="the executor's --cpu-kernels (e.g. another machine's choice: linear:33+=torch)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the executor")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV-cache bytes of the executor (default: 2 GiB on CPU, the free-memory share on CUDA)")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="the most decode steps per plan of the engine peers (nanoserve-scheduler "
                   "--num-scheduler-steps; default: its default)")
    p.add_argument("--scheduling-policy", choices=POLICY_NAMES, default=ServiceConfig().scheduling_policy,
                   help="the engine peers' scheduling policy (nanoserve-scheduler --scheduling-policy; default: its "
                   "default, %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every peer, in turn (every other round in "
                   "reverse); each peer's median counts (this machine's load drifts between runs, and alternating "
                   "rounds spreads it alike)")
    p.add_argument("--json", type=Path, default=None, help="write <peer>_tok_s, the ratios and peak_rss_mb here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = WORKLOADS[args.workload]().head(args.num_requests)
    tokens = sum(workload.max_tokens)
    peers = llamacpp.admit(args, [name for name in args.peers or PEERS if not (name in HF_PEERS and args.skip_hf)])
    peers = vllm_setup.admit(args, peers)
    if not peers:
        raise SystemExit("no peer left to run")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    runs: dict[str, list[float]] = {name: [] for name in peers}
    stolen: dict[str, list[float]] = {name: [] for name in peers}
    for round_ in range(args.repeats):
        # Every other round in reverse (A B, B A, ...): a machine slowing down or speeding up within a round then
        # weighs on every peer alike, not always on the later one.
        for name in peers if round_ % 2 == 0 else peers[::-1]:
            with StolenCpu() as steal:
                runs[name].append(PEERS[name](args, workload))
            stolen[name].append(steal.share)
            # Each run's figure as it lands, so a run cut short (a time limit, a peer that fails) still leaves those.
            print(f"round {round_ + 1} {name}: {runs[name][-1]:.1f} s, {tokens / runs[name][-1]:.1f} tok/s",
                  file=sys.stderr, flush=True)
            release_gpu_memory()
    seconds = {name: statistics.median(times) for name, times in runs.items()}
    tok_s = {name: tokens / s for name, s in seconds.items()}
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{workload.name.upper()}: {len(workload)} requests, {tokens} tokens, {args.dtype}, {args.device}, "
          f"{args.threads} threads, {args.scheduling_policy} policy", file=sys.stderr)
    hf, inprocess = tok_s.get("hf"), tok_s.get("inprocess")
    # Each round's ratio first: the machine's drift between rounds cancels out.
    paired = ({name: statistics.median(base / t for base, t in zip(runs["inprocess"], runs[name], strict=True))
               for name in peers if name != "inprocess"} if "inprocess" in runs else {})
    print_table(
        ["peer", "seconds", "runs (s)", "stolen CPU (%)", "tok/s", "vs hf", "vs inprocess", "paired rounds"],
        [[name, seconds[name], " ".join(f"{t:.1f}" for t in runs[name]),
          " ".join(f"{100 * share:.0f}" for share in stolen[name]), tok_s[name], tok_s[name] / hf if hf else "-",
          tok_s[name] / inprocess if inprocess else "-", paired.get(name, "-")] for name in peers],
    )
    print(f"peak RSS of this process: {peak_rss_mb:.0f} MB")
    ratios = {f"{name}_over_{base}": tok_s[name] / tok_s[base]
              for name in peers for base in ("hf", "inprocess") if base in tok_s and name != base}
    write_json(args.json, {**{f"{name}_tok_s": v for name, v in tok_s.items()},
                           **{f"{name}_stolen_cpu_share": statistics.median(v) for name, v in stolen.items()},
                           **ratios, **{f"{name}_paired_over_inprocess": v for name, v in paired.items()},
                           "peak_rss_mb": peak_rss_mb, "repeats": args.repeats,
                           "scheduling_policy": args.scheduling_policy})


if __name__ == "__main__":
    main()
