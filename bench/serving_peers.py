"""The servers W3 drives and the outside client it may drive them with.

``launch`` starts the stacks of a single run (``--launch shadow`` or ``real``). For peers run in turn, nanoserve is
started as ``make run`` starts it (``python -m client.stack``, default flags, the dtype passed through) and driven
over gRPC (``nanoserve``; ``nanoserve_mixed`` with the mixed scheduling policy) or its OpenAI endpoint
(``nanoserve_openai``); ``vllm`` is ``vllm serve`` at the settings
of bench/vllm_setup.py, driven over its OpenAI endpoint. ``run_vllm_bench`` drives an OpenAI endpoint with
``vllm bench serve`` instead of this package's client and reads back its per-request figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from bench import vllm_setup
from bench.common import HOST, REPO_ROOT, Child, Workload, free_port
from bench.serving_load import RequestResult, short_of
from client.stack import DEFAULT_MODEL, executor_service, scheduler_service

BLOCK_SIZE = 16
SHADOW_VOCAB_SIZE = 49152
PEERS = ("nanoserve", "nanoserve_openai", "nanoserve_mixed", "vllm")
DEFAULT_PEERS = ("nanoserve", "nanoserve_openai", "vllm")
# Driven over gRPC; the others over their OpenAI endpoint. ``nanoserve_mixed``: the stack at ``--scheduling-policy
# mixed``, its only flag away from the defaults.
GRPC_PEERS = ("nanoserve", "nanoserve_mixed")
STOP_GRACE_S = 30.0


def default_dtype() -> str:
    """The dtype ``make run``'s executor picks on this CPU, so that a run without ``--dtype`` measures what users
    get (and gives the vLLM peer the same)."""
    from executor_svc.runtime.config import ExecutorOptions

    return ExecutorOptions(device="cpu").resolved_dtype()


def launch(kind: str, workload: Workload, stack: ExitStack, max_num_seqs: int, threads: int, dtype: str,
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
                "--dtype", dtype, "--max-model-len", str(workload.max_model_len), "--threads", str(threads)]
    executor = stack.enter_context(Child("executor", argv, log_dir / "executor.log"))
    executor.wait_serving(f"{HOST}:{executor_port}", timeout_s)
    argv = [sys.executable, "-m", "scheduler_svc", "--executor", f"{HOST}:{executor_port}",
            "--port", str(scheduler_port), "--max-num-seqs", str(max_num_seqs), "--log-level", "WARNING",
            "--http-port", str(http_port)]
    scheduler = stack.enter_context(Child("scheduler", argv, log_dir / "scheduler.log"))
    scheduler.wait_serving(f"{HOST}:{scheduler_port}", timeout_s)
    return f"{HOST}:{scheduler_port}", f"http://{HOST}:{http_port}/v1"


@dataclass(frozen=True)
class Server:
    """A running server: its gRPC address (nanoserve only) and its OpenAI base URL (``http://host:port/v1``)."""

    grpc_target: str | None
    base_url: str

    def served_model(self) -> str:
        """The first model /v1/models lists."""
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=10) as response:
            return json.load(response)["data"][0]["id"]


def model_name() -> str:
    """The model ``make run`` serves: NANOSERVE_MODEL, else the embedded default."""
    return os.environ.get("NANOSERVE_MODEL", DEFAULT_MODEL)


def model_folder(model: str) -> str:
    """The local Hugging Face folder of ``model`` (the embedded model converted once), which vLLM loads offline."""
    from executor_svc.runtime.registry import resolve_model

    return str(resolve_model(model))


def checkout_env(policy: str | None, model: str | None) -> dict[str, str]:
    """This process's environment with this checkout first on the Python path (the services import its code, not an
    install's), and the NANOSERVE_* variables of ``policy`` (the scheduler's ``--scheduling-policy`` where not its
    default) and ``model`` (the executor's, where not NANOSERVE_MODEL's or the embedded one)."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), str(REPO_ROOT / "protos"), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, **({"NANOSERVE_SCHEDULING_POLICY": policy} if policy else {}),
            **({"NANOSERVE_MODEL": model} if model else {})}


def start_nanoserve(stack: ExitStack, dtype: str, log: Path, timeout_s: float, policy: str | None = None,
                    model: str | None = None) -> Server:
    """``python -m client.stack`` on free ports, its children importing this checkout's code."""
    port, executor_port, http_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "client.stack", "--port", str(port), "--executor-port", str(executor_port),
            "--http-port", str(http_port), "--dtype", dtype]
    child = stack.enter_context(Child("nanoserve stack", argv, log, env=checkout_env(policy, model), group=True,
                                      grace_s=STOP_GRACE_S))
    child.wait_serving(f"{HOST}:{port}", timeout_s)
    base_url = f"http://{HOST}:{http_port}/v1"
    child.wait_http(f"{base_url}/models", timeout_s)
    return Server(f"{HOST}:{port}", base_url)


def start_nanoserve_pair(stack: ExitStack, dtype: str, log: Path, timeout_s: float, policy: str | None = None,
                         model: str | None = None, device: str = "cuda") -> Server:
    """The pair as docker-compose.yml runs it on one GPU (the executor at ``NANOSERVE_DEVICE=cuda``, every other
    flag at its default), each service a ``python -m`` of this checkout, on free ports; logs beside ``log``.
    ``device``: the executor's, cuda but for a test on the CPU."""
    port, executor_port, http_port = free_port(), free_port(), free_port()
    env = checkout_env(policy, model)
    # The make run stack's variables for each service, but for the executor's device (and model, where named).
    service = executor_service(executor_port, False, dtype)
    executor_env = {**env, **service.env, "NANOSERVE_DEVICE": device,
                    "NANOSERVE_MODEL": env.get("NANOSERVE_MODEL", service.env["NANOSERVE_MODEL"])}
    executor = stack.enter_context(Child("executor", [sys.executable, "-m", "executor_svc"],
                                         log.with_name(f"{log.stem}-executor.log"), env=executor_env))
    executor.wait_serving(f"{HOST}:{executor_port}", timeout_s)
    scheduler_env = {**env, **scheduler_service(port, executor_port, http_port).env}
    scheduler = stack.enter_context(Child("scheduler", [sys.executable, "-m", "scheduler_svc"],
                                          log.with_name(f"{log.stem}-scheduler.log"), env=scheduler_env, group=True,
                                          grace_s=STOP_GRACE_S))
    scheduler.wait_serving(f"{HOST}:{port}", timeout_s)
    base_url = f"http://{HOST}:{http_port}/v1"
    scheduler.wait_http(f"{base_url}/models", timeout_s)
    return Server(f"{HOST}:{port}", base_url)


def start_vllm(stack: ExitStack, venv: vllm_setup.VllmEnv, dtype: str, log: Path, timeout_s: float,
               model: str) -> Server:
    """``vllm serve`` of ``model`` at vLLM's CPU settings, serving it under nanoserve's name for it."""
    port = free_port()
    argv = [venv.command, "serve", model_folder(model), "--served-model-name", model,
            "--dtype", dtype, "--max-model-len", str(vllm_setup.MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(vllm_setup.KV_CACHE_BYTES), "--host", HOST, "--port", str(port)]
    child = stack.enter_context(Child("vllm serve", argv, log, env=venv.env(), group=True,
                                      grace_s=STOP_GRACE_S))
    base_url = f"http://{HOST}:{port}/v1"
    child.wait_http(f"{base_url}/models", timeout_s)
    return Server(None, base_url)


def vllm_bench_argv(venv: vllm_setup.VllmEnv, server: Server, workload: Workload, request_rate: float, seed: int,
                    result: Path) -> list[str]:
    """``vllm bench serve`` with W3's shape (its ``random`` dataset, EOS ignored, greedy) at ``request_rate``."""
    model = server.served_model()
    return [venv.command, "bench", "serve", "--backend", "openai", "--base-url", server.base_url.removesuffix("/v1"),
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model_folder(model), "--dataset-name",
            "random", "--random-input-len", str(len(workload.prompts[0])),
            "--random-output-len", str(workload.max_tokens[0]), "--num-prompts", str(len(workload)),
            "--request-rate", str(request_rate), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
            "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]


def results_from_vllm_bench(data: dict) -> tuple[list[RequestResult], float]:
    """``vllm bench serve``'s saved result (with ``--save-detailed``) as this package's per-request results, so that
    both clients' figures come from the same code; and its duration."""
    first = min(data["start_times"]) if data["start_times"] else 0.0
    results = [
        RequestResult(output_tokens=tokens, ttft_s=ttft, latency_s=latency, sent_s=start - first, itl_s=list(itl),
                      error=error or None)
        for tokens, ttft, latency, start, itl, error in zip(
            data["output_lens"], data["ttfts"], data["latencies"], data["start_times"], data["itls"], data["errors"],
            strict=True)
    ]
    return results, data["duration"]


def run_vllm_bench(venv: vllm_setup.VllmEnv, server: Server, workload: Workload, request_rate: float, seed: int,
                   result: Path) -> tuple[list[RequestResult], float]:
    """One ``vllm bench serve`` run against ``server``, saving to ``result`` (its log beside it); its per-request
    results and duration."""
    argv = vllm_bench_argv(venv, server, workload, request_rate, seed, result)
    with open(result.with_suffix(".log"), "w") as log:
        code = subprocess.run(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=venv.env()).returncode
    if code != 0 or not result.is_file():
        tail = "\n".join(result.with_suffix(".log").read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve exited with code {code}; its log ends:\n{tail}")
    results, duration = results_from_vllm_bench(json.loads(result.read_text()))
    for one in results:  # its --random-output-len: every request asks the same, EOS ignored
        one.error = one.error or short_of(one, workload.max_tokens[0])
    return results, duration
