"""What every benchmark shares: the workloads of BENCHMARKS.md, child services, tables and JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

HOST = "127.0.0.1"
SERVING = health_pb2.HealthCheckResponse.SERVING
# Children run ``python -m`` from here, so ``bench`` resolves wherever the benchmark was started.
REPO_ROOT = Path(__file__).resolve().parents[1]
# What every throughput peer generates from (4 tokens) before its timed run.
WARMUP_PROMPT = list(range(100, 132))


@dataclass(frozen=True)
class Workload:
    """Request i is ``prompts[i]`` with ``max_tokens[i]``, generated with ``ignore_eos`` (and greedy on W1)."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    max_model_len: int

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, n: int | None) -> Workload:
        """The first ``n`` requests (all when ``n`` is None): a prefix of the same draw, not a new one."""
        return Workload(self.name, self.prompts[:n], self.max_tokens[:n], self.temperature, self.max_model_len)

    def redrawn(self, seed: int) -> Workload:
        """The same shape (prompt lengths, limits) with new random prompt ids from ``seed``: a server that ran this
        workload finds none of them in its prefix cache, as a later run of vLLM's random dataset would not."""
        rng = random.Random(f"{self.name}-{seed}")
        prompts = [[rng.randint(0, 10000) for _ in prompt] for prompt in self.prompts]
        return Workload(self.name, prompts, self.max_tokens, self.temperature, self.max_model_len)


def _draw(name: str, num_requests: int, prompt_lens: tuple[int, int], max_tokens: tuple[int, int],
          temperature: float, max_model_len: int) -> Workload:
    # A private Random(0) draws exactly what random.seed(0) and the module functions would, without touching them.
    rng = random.Random(0)
    prompts, limits = [], []
    for _ in range(num_requests):
        prompts.append([rng.randint(0, 10000) for _ in range(rng.randint(*prompt_lens))])
        limits.append(rng.randint(*max_tokens))
    return Workload(name, prompts, limits, temperature, max_model_len)


def w1() -> Workload:
    """W1 (CPU): 64 requests, prompts of 32-256 ids in [0, 10000], max_tokens 32-256, greedy."""
    return _draw("w1", 64, (32, 256), (32, 256), 0.0, 2048)


def w2() -> Workload:
    """W2 (GPU): 256 requests, prompts of 100-1024 ids in [0, 10000], max_tokens 100-1024, temperature 0.6."""
    return _draw("w2", 256, (100, 1024), (100, 1024), 0.6, 4096)


def w3() -> Workload:
    """W3 (CPU): 64 requests, random prompts of 256 ids in [0, 10000], 128 output tokens each, greedy: the shape of
    vLLM's ``random`` dataset at ``--random-input-len 256 --random-output-len 128``."""
    return _draw("w3", 64, (256, 256), (128, 128), 0.0, 1024)


def w6() -> Workload:
    """W6 (speculative decoding): 32 requests, each a block of 48 random ids repeated 4 times (a pattern the model
    continues by copying), 128 output tokens, greedy."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(48)] * 4 for _ in range(32)]
    return Workload("w6", prompts, [128] * 32, 0.0, 1024)


WORKLOADS = {"w1": w1, "w2": w2, "w3": w3, "w6": w6}


def progress(iterable: Iterable | None = None, **kwargs) -> tqdm:
    """A progress bar on stderr, so stdout keeps only the table."""
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False, **kwargs)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table on stdout, ready to paste into docs/benchmarks-history.md."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for row, values in zip(cells, rows, strict=True):
        aligned = [c.rjust(w) if isinstance(v, int | float) else c.ljust(w)
                   for c, v, w in zip(row, values, widths, strict=True)]
        print("| " + " | ".join(aligned) + " |")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def write_json(path: Path | None, figures: dict[str, object]) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation, as vLLM's serving benchmark reports), 0.0 for no values."""
    return float(np.percentile(values, q)) if len(values) else 0.0


class StolenCpu:
    """The share of the machine's CPU time its hypervisor gave to other guests while the ``with`` block ran (Linux
    ``steal``; 0.0 elsewhere). On a shared VM it changes from one round to the next and only ever slows a
    round down: a benchmark prints it beside each round."""

    share: float = 0.0

    def __enter__(self) -> StolenCpu:
        self._start = psutil.cpu_times()
        return self

    def __exit__(self, *exc_info: object) -> None:
        end = psutil.cpu_times()
        # guest and guest_nice are counted in user and nice already.
        total = sum(end) - sum(self._start) - sum(getattr(end, f) - getattr(self._start, f)
                                                  for f in ("guest", "guest_nice") if hasattr(end, f))
        stolen = getattr(end, "steal", 0.0) - getattr(self._start, "steal", 0.0)
        self.share = stolen / total if total > 0 else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Child:
    """A service subprocess, stopped (SIGTERM, then SIGKILL) on exit from the ``with`` block. ``group``: it runs in a
    process group of its own, and whatever of that group outlives ``grace_s`` after the SIGTERM is killed with it
    (a server that starts processes of its own, such as ``vllm serve`` or ``client.stack``)."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None = None, env: dict[str, str] | None = None,
                 group: bool = False, grace_s: float = 10.0) -> None:
        self.name = name
        self.group = group
        self.grace_s = grace_s
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                        start_new_session=group)

    def wait_serving(self, target: str, timeout_s: float) -> None:
        """Poll grpc.health.v1 until SERVING; raise when the process dies or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the {self.name} exited with code {self.process.returncode}{self._log_tail()}")
                with contextlib.suppress(grpc.RpcError):
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"the {self.name} did not serve on {target} within {timeout_s:.0f}s")

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200; raise when the process dies or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} exited with code {self.process.returncode}{self._log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the {self.name} did not answer {url} within {timeout_s:.0f}s")

    def _log_tail(self, lines: int = 30) -> str:
        if self.log is subprocess.DEVNULL:
            return ""
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace").splitlines()[-lines:]
        return "; its log ends:\n" + "\n".join(tail)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.group:  # the group's id is the child's pid: only what it started is in it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
