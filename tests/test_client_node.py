"""The Node.js example client (examples/node) against a real scheduler + echo executor pair."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import smg_grpc_proto

from tests.service_fixtures import ROOT

if TYPE_CHECKING:
    from tests.client_fixtures import EchoServer

pytest_plugins = ["tests.client_fixtures"]

EXAMPLE = ROOT / "examples" / "node"
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the example's two npm dependencies installed (once, from its lock file)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed; the example needs Node.js >= 18")
    if not (EXAMPLE / "node_modules").is_dir():
        npm = shutil.which("npm")
        installed = npm and subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE,
                                           capture_output=True, timeout=300).returncode == 0
        if not installed:
            pytest.skip("`npm ci` in examples/node failed (no npm or no registry access)")
    return node


def run_example(node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([node, str(EXAMPLE / "generate.js"), *argv], capture_output=True, text=True, timeout=60)


def test_node_client_streams_the_same_completion(node: str, echo_server: EchoServer) -> None:
    text, token_ids = echo_server.echo(PROMPT, 9)
    streamed = run_example(node, "--server", echo_server.target, "--max-tokens", "9", PROMPT)
    assert (streamed.returncode, streamed.stdout) == (0, text + "\n"), streamed.stderr
    result = run_example(node, "--server", echo_server.target, "--max-tokens", "9", "--json", PROMPT)
    completion = json.loads(result.stdout)
    assert (completion["text"], completion["token_ids"], completion["finish_reason"]) == (text, token_ids, "length")
    assert completion["usage"]["completion_tokens"] == 9


def test_node_client_sends_token_prompts_and_reports_errors(node: str, echo_server: EchoServer) -> None:
    result = run_example(node, "--server", echo_server.target, "--token-ids", "5,6,7", "--max-tokens", "4", "--json")
    assert json.loads(result.stdout)["token_ids"] == [5, 6, 7, 5]
    rejected = run_example(node, "--server", echo_server.target, "--max-tokens", "0", PROMPT)
    assert rejected.returncode == 1
    assert rejected.stderr.startswith("error: INVALID_ARGUMENT: ") and "max_tokens" in rejected.stderr


def test_node_client_sends_a_structured_output_constraint(node: str, echo_server: EchoServer) -> None:
    accepted = run_example(node, "--server", echo_server.target, "--regex", "[a-z ]+", "--max-tokens", "4",
                           "--json", PROMPT)
    assert accepted.returncode == 0, accepted.stderr
    rejected = run_example(node, "--server", echo_server.target, "--regex", "(unclosed", PROMPT)
    assert rejected.returncode == 1
    assert rejected.stderr.startswith("error: INVALID_ARGUMENT: structured_output.regex"), rejected.stderr


def test_node_streams_vllm_engine_generate_from_the_running_stack(node: str, echo_server: EchoServer) -> None:
    """The gateways' protocol from another language: examples/node/vllm_engine.js, its stub built from the proto
    smg-grpc-proto ships, streams chunks of token ids and a final GenerateComplete."""
    proto_dir = Path(smg_grpc_proto.__file__).parent / "proto"
    _, token_ids = echo_server.echo(PROMPT, 9)
    result = subprocess.run([node, str(EXAMPLE / "vllm_engine.js"), "--proto-dir", str(proto_dir), "--server",
                             echo_server.target, "--max-tokens", "9", PROMPT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    *chunks, last = result.stdout.splitlines()
    complete = json.loads(last)
    assert [int(t) for line in chunks for t in line.split(",")] == token_ids == complete["output_ids"]
    assert (complete["finish_reason"], complete["completion_tokens"]) == ("length", 9)
