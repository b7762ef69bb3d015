"""The whole stack locked down: mTLS on the executor hop, TLS and an API key on the public API, used via the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import ssl
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import httpx
import pytest

from client.api import AsyncClient, Client
from client.cli import EXIT_ERROR, EXIT_UNAVAILABLE, main
from client.errors import NanoserveError
from common.security import TLSConfig, channel_credentials
from executor_svc.fakes.shadow import reference_generate
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.service_fixtures import HOST, START_TIMEOUT_S, executor_argv, free_port, spawn, stop_process
from tests.test_security import make_ca, make_leaf

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

API_KEY = "key-for-the-test"
SHADOW = dict(num_blocks=64, block_size=4, vocab_size=50, eos_token_ids=0)
PROMPT = [5, 6, 7]


@dataclass(frozen=True)
class SecureStack:
    target: str
    executor_target: str
    ca: str
    scheduler_cert: str
    scheduler_key: str
    http_url: str

    def cli(self, *argv: str) -> list[str]:
        return [*argv, "--server", self.target, "--tls-ca", self.ca]


def wait_secure_serving(client: Client, process, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        with contextlib.suppress(NanoserveError):
            if client.health() == "SERVING":
                return
        assert time.monotonic() < deadline, "the secure stack did not start"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    folder = tmp_path_factory.mktemp("secure")
    ca = make_ca(folder, "ca")
    server_names = "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    executor_cert, executor_key = make_leaf(folder, "executor", ca, server_names + "extendedKeyUsage=serverAuth\n")
    scheduler_cert, scheduler_key = make_leaf(folder, "scheduler", ca,
                                              server_names + "extendedKeyUsage=serverAuth,clientAuth\n")
    executor_port, port, http_port = free_port(), free_port(), free_port()
    executor = spawn(executor_argv("shadow", executor_port, {**SHADOW, "tls_cert": executor_cert,
                                                             "tls_key": executor_key, "tls_ca": ca[0]}),
                     folder / "executor.log")
    argv = [sys.executable, "-m", "scheduler_svc", "--host", HOST, "--port", str(port),
            "--executor", f"{HOST}:{executor_port}", "--tls-cert", scheduler_cert, "--tls-key", scheduler_key,
            "--http-port", str(http_port),
            "--executor-tls-ca", str(ca[0]), "--executor-tls-cert", scheduler_cert, "--executor-tls-key", scheduler_key]
    with mock.patch.dict(os.environ, {"NANOSERVE_API_KEY": API_KEY}):
        scheduler = spawn(argv, folder / "scheduler.log")
    secure = SecureStack(f"{HOST}:{port}", f"{HOST}:{executor_port}", str(ca[0]), scheduler_cert, scheduler_key,
                         f"https://{HOST}:{http_port}")
    try:
        with Client(secure.target, timeout=5, api_key=API_KEY, tls=TLSConfig(ca_file=secure.ca)) as client:
            wait_secure_serving(client, scheduler)
            yield secure
            stats = client.stats()
            assert stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0
        tls = TLSConfig(scheduler_cert, scheduler_key, secure.ca)
        remote = RemoteExecutor(secure.executor_target, step_timeout_s=5, credentials=channel_credentials(tls))
        try:
            assert remote.reset() == 0, "the executor still held requests"
        finally:
            remote.close()
    finally:
        stop_process(scheduler)
        stop_process(executor)


def expected(max_tokens: int) -> list[int]:
    return reference_generate(PROMPT, max_tokens, SHADOW["vocab_size"], {0}, ignore_eos=True)


def generate_argv(stack: SecureStack, max_tokens: int) -> list[str]:
    return stack.cli("generate", "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(max_tokens),
                     "--ignore-eos", "--json")


def test_the_cli_generates_over_tls_with_the_api_key(stack: SecureStack, capsys: pytest.CaptureFixture[str]):
    assert main([*generate_argv(stack, 6), "--api-key", API_KEY]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected(6)


def test_the_cli_takes_the_api_key_from_the_environment(stack: SecureStack, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NANOSERVE_API_KEY", API_KEY)
    assert main(generate_argv(stack, 4)) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected(4)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_without_the_right_key_the_call_is_unauthenticated(stack: SecureStack, key: str | None,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    argv = generate_argv(stack, 4) + (["--api-key", key] if key else [])
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "authorization: Bearer <key>" in err
    assert main(stack.cli("health")) == 0, "health checks need no key"


def test_plaintext_cannot_reach_the_tls_server(stack: SecureStack, capsys: pytest.CaptureFixture[str]):
    argv = ["generate", "--token-ids", "1,2", "--server", stack.target, "--api-key", API_KEY, "--timeout", "5"]
    assert main(argv) == EXIT_UNAVAILABLE
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_the_http_api_serves_the_same_certificate_and_key(stack: SecureStack):
    verify = ssl.create_default_context(cafile=stack.ca)
    body = {"model": "shadow-kv", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=stack.http_url, verify=verify) as http:
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 401
        reply = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.json()["choices"][0]["token_ids"] == expected(3)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(stack.http_url.replace("https://", "http://") + "/health")


def test_the_python_clients_over_tls(stack: SecureStack):
    tls = TLSConfig(ca_file=stack.ca)
    with Client(stack.target, timeout=30, api_key=API_KEY, tls=tls) as client:
        assert client.generate(token_ids=PROMPT, max_tokens=5, ignore_eos=True).token_ids == expected(5)

    async def streamed() -> list[int]:
        async with AsyncClient(stack.target, timeout=30, api_key=API_KEY, tls=tls) as client:
            return [t async for chunk in client.stream(token_ids=PROMPT, max_tokens=7, ignore_eos=True)
                    for t in chunk.token_ids]

    assert asyncio.run(streamed()) == expected(7)


def test_the_cli_checks_the_mtls_executor_with_a_client_certificate(stack: SecureStack,
                                                                    capsys: pytest.CaptureFixture[str]):
    argv = ["health", "--server", stack.executor_target, "--tls-ca", stack.ca]
    assert main([*argv, "--tls-cert", stack.scheduler_cert, "--tls-key", stack.scheduler_key]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main([*argv, "--timeout", "5"]) == EXIT_UNAVAILABLE, "without a client certificate"


def test_the_cli_refuses_a_certificate_without_its_key(stack: SecureStack, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as usage:
        main(["health", "--server", stack.target, "--tls-cert", stack.scheduler_cert])
    assert usage.value.code == 2 and "--tls-key" in capsys.readouterr().err
