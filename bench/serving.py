"""W3: online serving latency through a public API, gRPC or OpenAI's HTTP, with Poisson arrivals.

Requests (prompts and max_tokens drawn as W1 or W2, ``ignore_eos``) are sent at
``--request-rate`` per second with exponential gaps, each streamed: with
``client.api.AsyncClient`` (``--backend grpc``), or with the ``openai`` SDK's
AsyncOpenAI to ``/v1/completions`` (``--backend openai``; the prompts are token ids,
and vLLM's ``return_token_ids`` marks the first token even without a tokenizer).
Reports request throughput, output tokens/s, time to first token (TTFT), time per
output token after the first (TPOT) and end-to-end latency, as vLLM's serving
benchmark does. It targets a running server (``--server`` for gRPC, ``--base-url``
for HTTP; the key comes from OPENAI_API_KEY) or launches its own stack: ``--launch
shadow`` (the model-free shadow executor, no torch) or ``--launch real`` (the
embedded model on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import openai

from bench.common import HOST, WORKLOADS, Child, Workload, free_port, percentile, print_table, progress, write_json
from client.api import AsyncClient
from client.errors import NanoserveError

BLOCK_SIZE = 16
SHADOW_VOCAB_SIZE = 49152


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between output tokens after the first; None for a single token."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def send(client: AsyncClient, prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        async for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, temperature=temperature,
                                         ignore_eos=True):
            if chunk.token_ids and not result.output_tokens:
                result.ttft_s = time.perf_counter() - start
            result.output_tokens += len(chunk.token_ids)
    except NanoserveError as e:
        result.error = str(e)
    result.latency_s = time.perf_counter() - start
    return result


async def send_openai(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                      temperature: float) -> RequestResult:
    """One streamed /v1/completions; the output tokens are the last chunk's usage."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
            elif not result.ttft_s and chunk.choices and (chunk.choices[0].text
                                                          or getattr(chunk.choices[0], "token_ids", None)):
                result.ttft_s = time.perf_counter() - start
    except openai.APIError as e:
        result.error = str(e)
    result.latency_s = time.perf_counter() - start
    return result


Send = Callable[[list[int], int, float], Awaitable[RequestResult]]


@contextlib.asynccontextmanager
async def grpc_backend(target: str) -> AsyncIterator[Send]:
    async with AsyncClient(target) as client:
        await client.health()
        yield functools.partial(send, client)


@contextlib.asynccontextmanager
async def openai_backend(base_url: str) -> AsyncIterator[Send]:
    """The served model is the first that /v1/models lists; no retries, so a refusal counts as failed."""
    api_key = os.environ.get("OPENAI_API_KEY", "none")
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        yield functools.partial(send_openai, client, model)


async def run_load(backend: contextlib.AbstractAsyncContextManager[Send], workload: Workload, request_rate: float,
                   seed: int) -> tuple[list[RequestResult], float]:
    """Send every request of ``workload`` with Poisson arrivals; return the results and the wall seconds."""
    gaps = random.Random(seed)
    async with backend as send_one:
        bar = progress(total=len(workload), desc=f"W3 {workload.name} @ {request_rate} req/s")
        tasks = []
        start = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(gaps.expovariate(request_rate))
            task = asyncio.create_task(send_one(prompt, max_tokens, workload.temperature))
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def launch(kind: str, workload: Workload, stack: ExitStack, max_num_seqs: int, threads: int,
           timeout_s: float) -> tuple[str, str]:
    """Start an executor and a scheduler as subprocesses; return the scheduler's gRPC address and HTTP base URL."""
    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    print(f"launching a {kind} stack; logs in {log_dir}", file=sys.stderr)
    executor_port, scheduler_port, http_port = free_port(), free_port(), free_port()
    if kind == "shadow":
        longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
        num_blocks = len(workload) * -(-longest // BLOCK_SIZE)
        argv = [sys.executable, "-m", "executor_svc.fakes.shadow_server", "--port", str(executor_port),
                "--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE),
                "--vocab-size", str(SHADOW_VOCAB_SIZE), "--max-model-len", str(workload.max_model_len),
                "--log-level", "WARNING"]
    else:
        argv = [sys.executable, "-m", "executor_svc", "--port", str(executor_port), "--device", "cpu",
                "--dtype", "float32", "--max-model-len", str(workload.max_model_len), "--threads", str(threads)]
    executor = stack.enter_context(Child("executor", argv, log_dir / "executor.log"))
    executor.wait_serving(f"{HOST}:{executor_port}", timeout_s)
    argv = [sys.executable, "-m", "scheduler_svc", "--executor", f"{HOST}:{executor_port}",
            "--port", str(scheduler_port), "--max-num-seqs", str(max_num_seqs), "--log-level", "WARNING",
            "--http-port", str(http_port)]
    scheduler = stack.enter_context(Child("scheduler", argv, log_dir / "scheduler.log"))
    scheduler.wait_serving(f"{HOST}:{scheduler_port}", timeout_s)
    return f"{HOST}:{scheduler_port}", f"http://{HOST}:{http_port}/v1"


def summarise(results: list[RequestResult], duration_s: float, request_rate: float) -> dict[str, float | None]:
    done = [r for r in results if r.error is None]
    ttft = [1e3 * r.ttft_s for r in done if r.output_tokens]
    tpot = [1e3 * r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [1e3 * r.latency_s for r in done]
    output_tokens = sum(r.output_tokens for r in done)
    figures: dict[str, float | None] = {
        "request_rate": request_rate if math.isfinite(request_rate) else None,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_tok_s": output_tokens / duration_s,
        "output_tokens": output_tokens,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        figures[f"{name}_mean_ms"] = sum(values) / len(values) if values else 0.0
        for q in (50, 90, 99):
            figures[f"{name}_p{q}_ms"] = percentile(values, q)
    return figures


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
    parser.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                        help="the API to drive: gRPC Generate, or OpenAI's /v1/completions (default: %(default)s)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--server", metavar="HOST:PORT", help="a running scheduler service (--backend grpc)")
    target.add_argument("--base-url", metavar="URL",
                        help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (--backend openai)")
    target.add_argument("--launch", choices=("shadow", "real"),
                        help="start an executor (shadow: model-free; real: the embedded model on CPU) and a scheduler")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w1", help="(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, help="send only the first N requests of the workload")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf sends all at once (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival gaps (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="scheduler budget of a launched stack "
                        "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a launched real executor "
                        "(default: %(default)s)")
    parser.add_argument("--launch-timeout", type=float, default=600.0,
                        help="seconds a launched service may take to serve (default: %(default)s)")
    parser.add_argument("--plot", type=Path, help="save latency histograms to this PNG (needs matplotlib)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0")
    if args.server and args.backend != "grpc" or args.base_url and args.backend != "openai":
        parser.error("--server goes with --backend grpc, --base-url with --backend openai")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    workload = WORKLOADS[args.workload]().head(args.num_prompts)
    with ExitStack() as stack:
        if args.launch:
            target, base_url = launch(args.launch, workload, stack, args.max_num_seqs, args.threads,
                                      args.launch_timeout)
        else:
            target, base_url = args.server, args.base_url
        backend = grpc_backend(target) if args.backend == "grpc" else openai_backend(base_url)
        results, duration = asyncio.run(run_load(backend, workload, args.request_rate, args.seed))
    figures = {"backend": args.backend, **summarise(results, duration, args.request_rate)}
    against = args.server or args.base_url or args.launch + " stack"
    print(f"W3 {workload.name}: {len(workload)} requests at {args.request_rate} req/s against {against} "
          f"({args.backend})")
    print_table(["metric", "value"], [
        ["completed / failed", f"{figures['completed']} / {figures['failed']}"],
        ["duration (s)", figures["duration_s"]],
        ["request throughput (req/s)", figures["request_throughput"]],
        ["output tokens/s", figures["output_tok_s"]],
        *([f"{name} p{q} (ms)", figures[f"{key}_p{q}_ms"]] for name, key in
          (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e")) for q in (50, 90, 99)),
    ])
    errors = sorted({r.error for r in results if r.error})
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if args.plot:
        plot(args.plot, results, f"W3 {workload.name}, {args.request_rate} req/s, {against}, {args.backend}")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
