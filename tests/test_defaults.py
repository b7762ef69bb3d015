"""One table of sampling and stopping defaults (``common.sampling.DEFAULTS``): what the proto comments,
the CLI help and docs/client.md say, what an unset GenerateRequest gets, and the docs' account of the loop."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from client.cli import build_parser
from common.sampling import DEFAULTS
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.core.validation import ModelLimits
from scheduler_svc.engine.supervision import IDLE_PROBE_S

ROOT = Path(__file__).resolve().parent.parent
# DEFAULTS key -> (proto message, proto field, CLI flag)
SURFACES = {
    "temperature": ("SamplingOptions", "temperature", "--temperature"),
    "top_k": ("SamplingOptions", "top_k", "--top-k"),
    "top_p": ("SamplingOptions", "top_p", "--top-p"),
    "min_p": ("SamplingOptions", "min_p", "--min-p"),
    "seed": ("SamplingOptions", "seed", "--seed"),
    "logprobs": ("SamplingOptions", "logprobs", "--logprobs"),
    "max_tokens": ("StoppingOptions", "max_tokens", "--max-tokens"),
    "stop": ("StoppingOptions", "stop", "--stop"),
    "stop_token_ids": ("StoppingOptions", "stop_token_ids", "--stop-token-id"),
    "ignore_eos": ("StoppingOptions", "ignore_eos", "--ignore-eos"),
    "repetition_penalty": ("SamplingOptions", "repetition_penalty", "--repetition-penalty"),
    "presence_penalty": ("SamplingOptions", "presence_penalty", "--presence-penalty"),
    "frequency_penalty": ("SamplingOptions", "frequency_penalty", "--frequency-penalty"),
    "logit_bias": ("SamplingOptions", "logit_bias", "--logit-bias"),
    "n": ("SamplingOptions", "n", "--n"),
    "min_tokens": ("StoppingOptions", "min_tokens", "--min-tokens"),
    "include_stop_str_in_output": ("StoppingOptions", "include_stop_str_in_output", "--include-stop-str-in-output"),
    "skip_special_tokens": ("GenerateRequest", "skip_special_tokens", "--keep-special-tokens"),
    "truncate_prompt_tokens": ("GenerateRequest", "truncate_prompt_tokens", "--truncate-prompt-tokens"),
    "prompt_logprobs": ("GenerateRequest", "prompt_logprobs", "--prompt-logprobs"),
}
VALUE = r"(none|true|false|-?\d+(?:\.\d+)?)"


def shown(value: object) -> str:
    """How every surface writes a default."""
    if value is None or (isinstance(value, (tuple, list, dict, frozenset)) and not value):
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def proto_comment(message: str, field: str) -> str:
    """The comment lines right above ``field`` in ``message`` of generation.proto."""
    text = (ROOT / "protos/nanoserve/v1/generation.proto").read_text()
    body = re.search(rf"message {message} \{{(.*?)\n\}}", text, re.S).group(1)
    lines = body.splitlines()
    at = next(i for i, line in enumerate(lines)
              if re.match(rf"\s*(optional |repeated )?[\w<>, ]+ {field} = \d+;", line))
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("//"):
            break
        comment.insert(0, line.strip().removeprefix("//").strip())
    return " ".join(comment)


def test_every_default_has_a_surface():
    assert set(SURFACES) == set(DEFAULTS)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_proto_comment_states_the_default(name: str):
    message, field, _ = SURFACES[name]
    match = re.search(rf"Default: {VALUE}", proto_comment(message, field))
    assert match and match.group(1) == shown(DEFAULTS[name])


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_the_cli_help_states_the_servers_default(name: str):
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flag = SURFACES[name][2]
    action = next(a for a in generate._actions if flag in a.option_strings)
    match = re.search(rf"server default {VALUE}", action.help or "")
    assert match and match.group(1) == shown(DEFAULTS[name])


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_docs_client_md_states_the_servers_default(name: str):
    flag = SURFACES[name][2]
    row = next(line for line in (ROOT / "docs/client.md").read_text().splitlines() if line.startswith(f"| `{flag}"))
    match = re.search(rf"server default {VALUE}", row)
    assert match and match.group(1) == shown(DEFAULTS[name])


def test_an_unset_request_gets_the_table():
    limits = ModelLimits(vocab_size=100, max_model_len=4096, num_blocks=1024, block_size=16)
    params = prepare(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2])), limits, None).params
    got = {name: shown(getattr(params, name)) for name in DEFAULTS if hasattr(params, name)}
    assert got == {name: shown(DEFAULTS[name]) for name in got}
    assert len(got) == len(DEFAULTS) - 1, "all but truncate_prompt_tokens, which acts on the prompt"


def test_docs_scheduler_md_states_the_idle_probe_interval():
    """It once said the idle loop does not poll; it probes the executor every IDLE_PROBE_S seconds."""
    text = (ROOT / "docs/scheduler.md").read_text()
    assert "does not poll" not in text
    assert f"every {IDLE_PROBE_S:g} s" in text
