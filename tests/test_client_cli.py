"""The ``nanoserve`` CLI against a real scheduler + echo executor pair (subprocesses)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from client.api import Client
from client.cli import (
    EXIT_ERROR,
    EXIT_REJECTED,
    EXIT_UNAVAILABLE,
    build_parser,
    generation_options,
    main,
    run_generation,
)
from client.request_builder import build_request
from client.results import Chunk, Usage
from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import TOKENIZER_VOCAB_SIZE, executor_argv, free_port, running_stack

if TYPE_CHECKING:
    from tests.client_fixtures import EchoServer

pytest_plugins = ["tests.client_fixtures"]

PROMPT = "Hello world"
NANOSERVE = Path(sys.executable).parent / "nanoserve"
# An ABORT does not say who asked for it: any client's Abort call, or the server's shutdown.
ABORTED = "error: ABORTED: the server aborted the generation (an Abort call, or its shutdown)\n"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_completion_text(capsys: pytest.CaptureFixture[str], echo_server: EchoServer) -> None:
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "9", PROMPT)
    assert (code, err) == (0, "")
    assert out == echo_server.echo(PROMPT, 9)[0] + "\n"


def test_generate_json_prints_text_token_ids_reason_and_usage(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "9",
                           "--temperature", "0", "--seed", "3", "--json", PROMPT)
    text, token_ids = echo_server.echo(PROMPT, 9)
    prompt_tokens = len(echo_server.tokenizer.encode(PROMPT).ids)
    assert code == 0
    assert json.loads(out) == {
        "text": text,
        "token_ids": token_ids,
        "finish_reason": "length",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 9, "cached_prompt_tokens": 0},
    }


def test_stop_strings_and_token_prompts(capsys: pytest.CaptureFixture[str], echo_server: EchoServer) -> None:
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--stop", "xyz", "--stop", " world",
                           "--json", PROMPT)
    assert code == 0 and json.loads(out)["text"] == "Hello" and json.loads(out)["finish_reason"] == "stop"
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids", "5,6,7",
                           "--max-tokens", "4", "--ignore-eos", "--json")
    assert code == 0 and json.loads(out)["token_ids"] == [5, 6, 7, 5]


def test_chat_applies_the_template_with_the_system_message(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, out, _ = run_cli(capsys, "chat", "--server", echo_server.target, "--system", "Be brief.",
                           "--max-tokens", "3", "--json", "Hello world")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    assert code == 0
    assert json.loads(out)["usage"]["prompt_tokens"] == echo_server.chat_prompt_tokens(messages)


def test_rejected_request_prints_the_code_and_message(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "0", PROMPT)
    assert code == EXIT_REJECTED
    assert err.startswith("error: INVALID_ARGUMENT: ") and "max_tokens" in err
    code, _, err = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids",
                           str(TOKENIZER_VOCAB_SIZE))
    assert code == EXIT_REJECTED and "vocabulary" in err


def test_values_a_request_cannot_carry_are_a_bad_command_line(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    for option in (["--max-tokens", "-5"], ["--seed", "-1"]):
        with pytest.raises(SystemExit) as bad:
            run_cli(capsys, "generate", "--server", echo_server.target, *option, PROMPT)
        assert bad.value.code == 2
        assert f"error: {option[0][2:].replace('-', '_')}: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        run_cli(capsys, "generate", "--server", "host-a,host-b", PROMPT)
    assert bad.value.code == 2 and "host-a" in capsys.readouterr().err
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--top-k", "-1", "--max-tokens", "2",
                           PROMPT)
    assert code == 0 and out.strip(), "top_k -1 disables it, as in vLLM"


def test_unreachable_server_exits_with_its_own_code(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "generate", "--server", f"127.0.0.1:{free_port()}", PROMPT)
    assert code == EXIT_UNAVAILABLE and out == ""
    assert err.startswith("error: UNAVAILABLE: ")


def test_a_call_past_its_timeout_exits_like_an_unreachable_server(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, _, err = run_cli(capsys, "generate", "--server", echo_server.target, "--timeout", "0.001", PROMPT)
    assert code == EXIT_UNAVAILABLE and err.startswith("error: DEADLINE_EXCEEDED: ")


def test_info_stats_and_health(capsys: pytest.CaptureFixture[str], echo_server: EchoServer) -> None:
    code, out, _ = run_cli(capsys, "info", "--server", echo_server.target)
    info = json.loads(out)
    assert code == 0 and info["model_id"] == "echo" and info["vocab_size"] == TOKENIZER_VOCAB_SIZE
    assert info["has_chat_template"] is True
    code, out, _ = run_cli(capsys, "stats", "--server", echo_server.target)
    stats = json.loads(out)
    assert code == 0 and stats["num_blocks"] > 0 and stats["num_steps"] > 0
    assert run_cli(capsys, "health", "--server", echo_server.target)[:2] == (0, "SERVING\n")


def test_console_script_reads_the_server_from_the_environment_and_the_prompt_from_stdin(
    echo_server: EchoServer,
) -> None:
    result = subprocess.run([str(NANOSERVE), "generate", "--max-tokens", "5", "--json", "-"], input=PROMPT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "NANOSERVE_SERVER": echo_server.target})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == echo_server.echo(PROMPT, 5)[0]


def test_a_bad_command_line_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--token-ids", "1,2", PROMPT])
    assert exit_info.value.code == 2
    assert "PROMPT or --token-ids" in capsys.readouterr().err


def test_a_generation_cut_short_by_a_server_shutdown_exits_1(tmp_path: Path) -> None:
    port = free_port()
    executor = executor_argv("shadow", port, {"max_model_len": 16_000})
    with running_stack(executor, tmp_path, executor_port=port, shutdown_grace=0) as stack:
        cli = subprocess.Popen([str(NANOSERVE), "generate", "--server", stack.target, "--token-ids", "1,2,3",
                                "--max-tokens", "15000", "--ignore-eos"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while stack.stub.GetStats(pb.GetStatsRequest(), timeout=5).num_running == 0:
            assert time.monotonic() < deadline and cli.poll() is None, "the generation never started"
            time.sleep(0.02)
        stack.scheduler.terminate()
        _, err = cli.communicate(timeout=60)
    assert (cli.returncode, err) == (1, ABORTED)


def test_the_server_ca_has_its_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """NANOSERVE_TLS_CA makes a service require client certificates; the CLI must not read it as its CA."""
    monkeypatch.setenv("NANOSERVE_TLS_CA", "services-client-ca.pem")
    monkeypatch.delenv("NANOSERVE_SERVER_CA", raising=False)
    assert build_parser().parse_args(["health"]).tls_ca is None
    monkeypatch.setenv("NANOSERVE_SERVER_CA", "server-ca.pem")
    assert build_parser().parse_args(["health"]).tls_ca == "server-ca.pem"


def test_n_choices_stream_labelled_by_index_and_print_one_json_line_each(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "4", "--n", "2", PROMPT)
    text = echo_server.echo(PROMPT, 4)[0]
    assert code == 0
    for index in (0, 1):
        pieces = [ast.literal_eval(line.split(" ", 1)[1]) for line in out.splitlines()
                  if line.startswith(f"[{index}] '")]
        assert "".join(pieces) == text and f"[{index}] finished: length" in out
    code, out, _ = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "4", "--n", "2",
                           "--json", PROMPT)
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1] and all(line["text"] == text for line in lines)
    assert lines[1]["usage"]["prompt_tokens"] == 0, "the prompt is counted once, on choice 0"


def test_every_new_option_reaches_the_server_and_bad_ones_name_their_field(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--max-tokens", "9", "--json",
                             "--stop", " world", "--include-stop-str-in-output", "--min-tokens", "1",
                             "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                             "--logit-bias", "5=-100", "--truncate-prompt-tokens", "50", "--keep-special-tokens",
                             PROMPT)
    assert (code, err) == (0, "") and json.loads(out)["text"] == "Hello world"
    code, _, err = run_cli(capsys, "generate", "--server", echo_server.target, "--n", "17", PROMPT)
    assert code == EXIT_REJECTED and "sampling.n" in err
    code, _, err = run_cli(capsys, "generate", "--server", echo_server.target, "--logit-bias", "7=200", PROMPT)
    assert code == EXIT_REJECTED and "sampling.logit_bias" in err


def test_tokenize_detokenize_and_abort(capsys: pytest.CaptureFixture[str], echo_server: EchoServer) -> None:
    code, out, _ = run_cli(capsys, "tokenize", "--server", echo_server.target, PROMPT)
    ids = echo_server.tokenizer.encode(PROMPT).ids
    assert code == 0 and json.loads(out) == {"token_ids": ids, "count": len(ids)}
    code, out, _ = run_cli(capsys, "detokenize", "--server", echo_server.target, ",".join(map(str, ids)))
    assert (code, out) == (0, PROMPT + "\n")
    code, out, _ = run_cli(capsys, "abort", "--server", echo_server.target, "no-such-request")
    assert code == 0 and json.loads(out) == {"aborted_request_ids": []}


def test_a_generation_another_client_aborted_exits_1_without_blaming_a_shutdown(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    class AbortedElsewhere(Client):
        """The stream an Abort call from another client ends: some text, then ABORT."""

        def stream(self, prompt: str | None = None, **options: object) -> Iterator[Chunk]:
            build_request(prompt, **options)
            yield Chunk("r", "Hel", [1], [], None, None)
            yield Chunk("r", "", [], [], "abort", Usage(2, 1, 0))

    args = build_parser().parse_args(["generate", "--server", echo_server.target, PROMPT])
    with AbortedElsewhere(echo_server.target) as client:
        assert run_generation(client, args, {"prompt": PROMPT}) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert (out, err) == ("Hel\n", ABORTED)
    assert "shutting down" not in err


def test_max_tokens_to_room_and_a_whole_prompt_from_the_command_line(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    # The echo server's model holds 256 tokens: the room a prompt of 3 leaves is 253.
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids", "5,6,7",
                             "--max-tokens-to-room", "--ignore-eos", "--truncate-prompt-tokens", "-1", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["usage"] == {"prompt_tokens": 3, "completion_tokens": 253, "cached_prompt_tokens": 0}
    options = generation_options(build_parser().parse_args(["generate", "--max-tokens-to-room", PROMPT]))
    assert options["max_tokens_to_room"] is True
    capped = generation_options(build_parser().parse_args(["generate", "--cap-max-tokens-to-room", PROMPT]))
    assert capped["cap_max_tokens_to_room"] is True
    assert generation_options(build_parser().parse_args(["generate", PROMPT]))["max_tokens_to_room"] is None


def test_truncation_side_right_keeps_the_prompts_first_tokens(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    # The echo executor repeats the prompt it kept: the first two of 5, 6, 7 from the right side.
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids", "5,6,7",
                             "--truncate-prompt-tokens", "2", "--truncation-side", "right", "--max-tokens", "2",
                             "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["token_ids"] == [5, 6]
    assert generation_options(build_parser().parse_args(["generate", PROMPT]))["truncation_side"] is None
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids", "5,6,7",
                             "--logprob-token-id", "6", "--max-tokens", "2", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["logprobs"] == [], "printed with the named tokens alone (the echo executor scores none)"


def test_repetition_detection_from_the_command_line(
    capsys: pytest.CaptureFixture[str], echo_server: EchoServer
) -> None:
    # The echo executor repeats the prompt: 5, 6, 7, 5, 6, 7 is the pattern of three, twice.
    code, out, err = run_cli(capsys, "generate", "--server", echo_server.target, "--token-ids", "5,6,7",
                             "--max-tokens", "20", "--repetition-detection", "3,2", "--json")
    assert (code, err) == (0, "")
    assert (json.loads(out)["token_ids"], json.loads(out)["finish_reason"]) == ([5, 6, 7, 5, 6, 7], "repetition")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--repetition-detection", "3", PROMPT])
