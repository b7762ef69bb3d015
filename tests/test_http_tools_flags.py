"""The tool and reasoning flags as vLLM spells them (and their environment forms), and the way they reach the HTTP
routes: a real scheduler process started with the flags on its command line hands them to its API process, which
reads tool calls and thinking out of its answers."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.config import parse_config
from tests.service_fixtures import HOST, executor_argv, free_port, running_stack
from tests.test_http_tools import ECHO_LAST, HERMES_ANSWER, QWEN_TOOLS_TEMPLATE, TOKENIZER, TOOLS, answering


def test_the_flags_are_vllms_with_their_environment_forms(capsys: pytest.CaptureFixture[str]):
    given = parse_config(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], {})
    assert given.chat_parsing() == ChatParsing(True, "hermes")
    from_env = parse_config([], {"NANOSERVE_ENABLE_AUTO_TOOL_CHOICE": "1", "NANOSERVE_TOOL_CALL_PARSER": "llama3_json"})
    assert from_env.chat_parsing() == ChatParsing(True, "llama3_json")
    for argv, words in ((["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                        (["--tool-call-parser", "granite"], "invalid choice: 'granite'")):
        with pytest.raises(SystemExit):
            parse_config(argv, {})
        assert words in capsys.readouterr().err


def test_the_command_line_flags_reach_the_api_process(tmp_path: Path):
    """The scheduler's flags, not the environment, configure the routes the API process (its child) serves."""
    (tmp_path / "tokenizer.json").write_text(TOKENIZER.to_str())
    (tmp_path / "template.jinja").write_text(ECHO_LAST + QWEN_TOOLS_TEMPLATE)
    port, http_port = free_port(), free_port()
    executor = executor_argv("echo", port, {"tokenizer_json": tmp_path / "tokenizer.json", "eos_token_ids": 0,
                                            "chat_template": tmp_path / "template.jinja", "max_model_len": 2048,
                                            "vocab_size": TOKENIZER.get_vocab_size()})
    with running_stack(executor, tmp_path / "logs", port, http_port=http_port, enable_auto_tool_choice="on",
                       tool_call_parser="hermes", reasoning_parser="qwen3"):
        client = openai.OpenAI(base_url=f"http://{HOST}:{http_port}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(**{**answering("<think>Weather.</think>" + HERMES_ANSWER, tools=TOOLS),
                                                  "model": "echo"})
    message = reply.choices[0].message
    assert (message.reasoning, message.content, len(message.tool_calls)) == ("Weather.", "Let me check.", 2)
