"""The Shepherd Model Gateway (``smg``, a Rust binary from PyPI) in front of nanoserve stacks, as a user runs it.

Tests that need it skip, saying so, where the binary is not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.service_fixtures import HOST, free_port, spawn, stop_process

START_TIMEOUT_S = 30.0
# The log line of a gRPC-mode gateway once it has the tokenizer GetTokenizer handed over (it answers 503 before).
TOKENIZER_LOADED = "Successfully loaded tokenizer"


def smg_binary() -> str:
    """The ``smg`` beside this interpreter (the test environment's), or on PATH; skips the test when neither."""
    found = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if found is None:
        pytest.skip("smg (the Shepherd Model Gateway) is not installed: `pip install smg`, as make test does")
    return found


@dataclass
class Gateway:
    process: object
    url: str
    log_path: Path
    metrics_url: str = ""  # its Prometheus endpoint's base URL

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=10).json()["workers"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self) -> openai.OpenAI:
        """No retries of our own: a test sees what the gateway answered."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)


@contextlib.contextmanager
def running_gateway(worker_urls: list[str], log_path: Path, *flags: str,
                    ready: dict[str, int] | None = None) -> Iterator[Gateway]:
    """``smg launch`` in front of ``worker_urls``, returned once every worker is registered and healthy and its log
    shows each line of ``ready`` as many times as it says."""
    port, metrics_port = free_port(), free_port()
    argv = [smg_binary(), "launch", "--host", HOST, "--port", str(port), "--prometheus-port", str(metrics_port),
            "--log-level", "info", "--shutdown-grace-period-secs", "0", "--worker-urls", *worker_urls, *flags]
    process = spawn(argv, log_path)
    gateway = Gateway(process, f"http://{HOST}:{port}", log_path, f"http://{HOST}:{metrics_port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not registered(gateway, len(worker_urls), ready):
            assert process.poll() is None, f"smg exited with {process.returncode}:\n{gateway.log()[-3000:]}"
            assert time.monotonic() < deadline, f"smg did not register the workers:\n{gateway.log()[-3000:]}"
            time.sleep(0.1)
        yield gateway
    finally:
        stop_process(process)


def registered(gateway: Gateway, count: int, ready: dict[str, int] | None) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        healthy = [w for w in gateway.workers() if w["is_healthy"] and w["status"] == "ready"]
        log = gateway.log()
        return len(healthy) == count and all(log.count(line) >= times for line, times in (ready or {}).items())
    return False
