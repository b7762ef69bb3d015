"""``make run``: the executor and the scheduler as two local processes, the way the compose CPU stack runs them.

Each service gets the command and NANOSERVE_* environment that docker-compose.cpu.yml gives its
container, except that both bind 127.0.0.1 and the scheduler finds the executor there. The
stack waits for grpc.health.v1 SERVING from each, prefixes and forwards their logs, and stops
both on Ctrl-C or SIGTERM, or when either one exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from client.api import Client
from client.errors import NanoserveError

HOST = "127.0.0.1"
EXECUTOR_PORT = 50052
SCHEDULER_PORT = 50051
HTTP_PORT = 8000
# What docker-compose.cpu.yml sets beyond the host, the port and the cache volume (tests/test_compose.py checks).
EXECUTOR_CPU_ENV = {"NANOSERVE_DEVICE": "cpu"}
DEFAULT_MODEL = "smollm2-135m-instruct"
STOP_GRACE_S = 10.0
POLL_S = 0.5
BIN = Path(sys.executable).parent


@dataclass
class Service:
    """One process of the stack: its command, the NANOSERVE_* variables it adds and where it answers health."""

    name: str
    argv: list[str]
    env: dict[str, str]
    target: str


def executor_service(port: int, shadow: bool, dtype: str | None = None) -> Service:
    """The embedded model on CPU, or with ``shadow`` the model-free test executor (no torch needed); ``dtype``
    replaces the executor's own choice (bfloat16 where the CPU multiplies it natively, else float32)."""
    if shadow:
        argv = [sys.executable, "-m", "executor_svc.fakes.shadow_server", "--host", HOST, "--port", str(port)]
        return Service("executor", argv, {}, f"{HOST}:{port}")
    env = {"NANOSERVE_HOST": HOST, "NANOSERVE_PORT": str(port),
           "NANOSERVE_MODEL": os.environ.get("NANOSERVE_MODEL", DEFAULT_MODEL), **EXECUTOR_CPU_ENV}
    if dtype is not None:
        env["NANOSERVE_DTYPE"] = dtype
    return Service("executor", [str(BIN / "nanoserve-executor")], env, f"{HOST}:{port}")


def scheduler_service(port: int, executor_port: int, http_port: int) -> Service:
    env = {"NANOSERVE_HOST": HOST, "NANOSERVE_PORT": str(port), "NANOSERVE_HTTP_PORT": str(http_port),
           "NANOSERVE_EXECUTOR": f"{HOST}:{executor_port}"}
    return Service("scheduler", [str(BIN / "nanoserve-scheduler")], env, f"{HOST}:{port}")


def forward_logs(name: str, stream: object) -> None:
    """Copy a child's output line by line, prefixed with its name."""
    for line in stream:
        sys.stderr.write(f"{name:>9} | {line}")
        sys.stderr.flush()


class Stack:
    """The running processes, started in order and stopped in reverse order."""

    def __init__(self) -> None:
        self.running: list[tuple[Service, subprocess.Popen]] = []
        self.stopping = threading.Event()

    def start(self, service: Service) -> None:
        # A session of its own: Ctrl-C reaches only the stack, which then stops the children in order.
        process = subprocess.Popen(service.argv, env={**os.environ, **service.env}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=forward_logs, args=(service.name, process.stdout), daemon=True).start()
        self.running.append((service, process))

    def wait_serving(self, service: Service, timeout_s: float | None = None) -> bool:
        """Poll grpc.health.v1 until SERVING; False when a process exits, the stack stops or ``timeout_s`` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with Client(service.target, timeout=2.0) as client:
            while not self.stopping.is_set() and (deadline is None or time.monotonic() < deadline):
                if self.exited() is not None:
                    return False
                with contextlib.suppress(NanoserveError):  # not listening yet
                    if client.health() == "SERVING":
                        return True
                time.sleep(POLL_S)
        return False

    def exited(self) -> tuple[Service, int] | None:
        """The first process that has exited, with its exit code."""
        for service, process in self.running:
            if process.poll() is not None:
                return service, process.returncode
        return None

    def stop(self) -> None:
        for service, process in reversed(self.running):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    print(f"nanoserve: the {service.name} ignored SIGTERM for {STOP_GRACE_S:.0f}s; killing it",
                          file=sys.stderr)
                    process.kill()
                    process.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client.stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shadow", action="store_true",
                        help="run the model-free shadow executor instead of the model (token-id prompts only)")
    parser.add_argument("--executor-only", action="store_true", help="run only the executor")
    parser.add_argument("--port", type=int, default=SCHEDULER_PORT, help="scheduler port (default %(default)s)")
    parser.add_argument("--executor-port", type=int, default=EXECUTOR_PORT, help="executor port (default %(default)s)")
    parser.add_argument("--http-port", type=int, default=HTTP_PORT,
                        help="port of the scheduler's OpenAI-compatible HTTP API, 0 for none (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the executor's dtype (default: bfloat16 on a CPU with avx512_bf16 or amx_bf16, else "
                        "float32, as the compose CPU stack)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    services = [executor_service(args.executor_port, args.shadow, args.dtype)]
    if not args.executor_only:
        services.append(scheduler_service(args.port, args.executor_port, args.http_port))
    stack = Stack()

    def on_signal(signum: int, frame: object) -> None:
        stack.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for service in services:
            print(f"nanoserve: starting the {service.name} on {service.target}", file=sys.stderr)
            stack.start(service)
            if not stack.wait_serving(service):
                break
        else:
            print_ready(services[-1], args.shadow, args.http_port)
        while not stack.stopping.is_set() and stack.exited() is None:
            stack.stopping.wait(POLL_S)
        died = stack.exited()
        if died is not None:
            service, code = died
            print(f"nanoserve: the {service.name} exited with code {code}; stopping the stack", file=sys.stderr)
    finally:
        stack.stop()
    print("nanoserve: stopped", file=sys.stderr)
    return 1 if died is not None else 0


def curl_line(model: str, http_port: int, shadow: bool) -> str:
    """A request to the HTTP API that works on this stack: chat with the model, token ids with the shadow executor."""
    if shadow:
        path, body = "completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 16, "return_token_ids": True}
    else:
        path, body = "chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                          "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    return (f"curl http://{HOST}:{http_port}/v1/{path} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


def print_ready(last: Service, shadow: bool, http_port: int) -> None:
    if last.name == "executor":
        print(f"nanoserve: the executor is serving on {last.target}", file=sys.stderr)
        return
    cli = os.path.relpath(BIN / "nanoserve")
    if cli.startswith(".."):
        cli = str(BIN / "nanoserve")
    server = "" if last.target == f"{HOST}:{SCHEDULER_PORT}" else f" --server {last.target}"
    prompt = "--json --token-ids 1,2,3" if shadow else '"The capital of France is"'
    print(f"nanoserve: ready. In another terminal run: {cli} generate{server} {prompt} "
          "--max-tokens 16 --temperature 0", flush=True)
    if http_port:
        with Client(last.target, timeout=10.0) as client:
            model = client.model_info().model_id
        print(f"nanoserve: or over HTTP (the OpenAI API): {curl_line(model, http_port, shadow)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
