"""A port in use: either service stops at start-up with one line naming it (exit status 1, no traceback), closes
what it had bound, and never serves beside another service on the same port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_svc.api import grpc_service as service
from scheduler_svc.config import ServiceConfig
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.service_fixtures import HOST, executor_argv, free_port, scheduler_argv, stop_process, wait_serving
from tests.test_service_options import echo


def refused(argv: list[str], port: int, named: str = "cannot bind") -> None:
    """``argv`` exits 1 at start-up, saying ``named`` and the address."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve: {named} {HOST}:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # grpc.aio's report, with nothing in it, of a server a failed start left for the interpreter's exit to shut down
    assert "excepthook" not in done.stderr, done.stderr


@pytest.mark.parametrize(("flag", "named"), [("port", "cannot bind"), ("http_port", "cannot bind the HTTP API on"),
                                             ("metrics_port", "cannot bind the metrics port on")])
def test_a_port_in_use_stops_the_scheduler_with_one_line_naming_it(flag: str, named: str):
    with socket.create_server((HOST, 0)) as busy:
        port = busy.getsockname()[1]
        refused(scheduler_argv(**{"port": 0, "executor_target": f"{HOST}:{free_port()}", flag: port}), port, named)


@pytest.mark.parametrize("api_process", [True, False])
def test_a_grpc_port_in_use_releases_the_http_ports_bound_before_it(api_process: bool):
    http_port, metrics_port = free_port(), free_port()
    with socket.create_server((HOST, 0)) as busy:
        config = ServiceConfig(host=HOST, port=busy.getsockname()[1], http_port=http_port, metrics_port=metrics_port,
                               api_process=api_process)

        async def start() -> None:
            await service.SchedulerServer(config, echo()).start()

        with pytest.raises(OSError, match=f"cannot bind {HOST}:{config.port}"):
            asyncio.run(start())
    for port in (http_port, metrics_port):
        socket.create_server((HOST, port)).close()


@pytest.mark.parametrize("kind", ["model", "shadow"])
def test_a_port_in_use_stops_the_executor_with_one_line_naming_it(
        kind: str, tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    with socket.create_server((HOST, 0)) as busy:
        port = busy.getsockname()[1]
        argv = (executor_argv("shadow", port, {}) if kind == "shadow" else
                [sys.executable, "-m", "executor_svc", "--host", HOST, "--port", str(port), "--kv-cache-memory", "4M",
                 "--model", str(tiny_model_folders["llama"])])
        refused(argv, port)


def test_a_second_executor_or_scheduler_on_a_port_in_use_fails_rather_than_sharing_it():
    """gRPC's default SO_REUSEPORT let the second serve beside the first, each taking some connections."""
    port, scheduler_port = free_port(), free_port()
    executor = subprocess.Popen(executor_argv("shadow", port, {}), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    scheduler = subprocess.Popen(scheduler_argv(scheduler_port, f"{HOST}:{port}"), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    try:
        wait_serving(f"{HOST}:{port}", executor)
        wait_serving(f"{HOST}:{scheduler_port}", scheduler)
        refused(executor_argv("shadow", port, {}), port)
        refused(scheduler_argv(scheduler_port, f"{HOST}:{port}"), scheduler_port)
        wait_serving(f"{HOST}:{scheduler_port}", scheduler)  # the first still serves
    finally:
        assert stop_process(scheduler) == 0
        assert stop_process(executor) == 0
