"""The scheduler's flags that would only fail once it binds its ports are refused at start, naming the flags."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.channels import server_options
from scheduler_svc.config import parse_config


def refused(argv: list[str], capsys: pytest.CaptureFixture, env: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_config(argv, env={} if env is None else env)
    assert exit_.value.code != 0
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "first", "second"), [
    (["--port", "8000"], "--port", "--http-port"),  # a vLLM user's --port, beside the default --http-port
    (["--metrics-port", "50051"], "--port", "--metrics-port"),
    (["--http-port", "9090", "--metrics-port", "9090"], "--http-port", "--metrics-port"),
])
def test_two_ports_on_one_number_are_refused_naming_both(argv: list[str], first: str, second: str,
                                                        capsys: pytest.CaptureFixture):
    error = refused(argv, capsys)
    assert f"{first} and {second} are both" in error
    if first == "--port" and second == "--http-port":
        assert "--port is the gRPC port" in error and "--http-port the OpenAI HTTP port" in error


def test_a_port_clash_from_the_environment_is_refused_too(capsys: pytest.CaptureFixture):
    assert "--port and --http-port are both 8000" in refused([], capsys, env={"NANOSERVE_PORT": "8000"})


@pytest.mark.parametrize("argv", [
    ["--port", "0", "--metrics-port", "0"],  # any free port; metrics off
    ["--http-port", "0", "--port", "8000"],  # HTTP off: its default 8000 is no clash
    ["--port", "0", "--http-port", "0", "--metrics-port", "0"],
])
def test_zero_ports_and_a_port_turned_off_clash_with_nothing(argv: list[str]):
    parse_config(argv, env={})


def test_a_message_bound_past_int32_is_refused_naming_the_flag(capsys: pytest.CaptureFixture):
    error = refused(["--max-message-bytes", str(2**31)], capsys)
    assert "--max-message-bytes" in error and "2147483647" in error
    largest = parse_config(["--max-message-bytes", str(2**31 - 1)], env={}).max_message_bytes
    server = grpc.server(ThreadPoolExecutor(1), options=server_options(largest))  # the largest one gRPC takes
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.stop(None)
