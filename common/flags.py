"""Command-line flags that can also come from ``NANOSERVE_<FLAG>``, parsed the same way by every program.

An environment variable is run through the flag's own type and choices, so a bad value fails at
start-up naming the variable, and a flag on the command line wins over it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping

from common.channels import GRPC_MAX_MESSAGE_BYTES

ENV_PREFIX = "NANOSERVE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``NANOSERVE_MAX_NUM_SEQS``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value not in TRUE_WORDS + FALSE_WORDS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(TRUE_WORDS + FALSE_WORDS)}, got {text!r}")
    return value in TRUE_WORDS


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def grpc_message_bytes(text: str) -> int:
    """A gRPC message bound in bytes: gRPC takes it as an int32, so a larger one would fail only at bind."""
    value = positive_int(text)
    if value > GRPC_MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at most {GRPC_MAX_MESSAGE_BYTES} (2**31 - 1: gRPC takes an int32), "
                                         f"got {value}")
    return value


def json_strings(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's --allowed-origins takes it: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r} ({e.msg})") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return tuple(value)


def json_object(text: str) -> dict[str, object]:
    """A JSON object, as vLLM's --default-chat-template-kwargs takes it: '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def file_or_text(text: str) -> str:
    """A file's text, or the text itself where it reads as a template, not a name (vLLM's --chat-template: a
    template's path, or the template itself, which holds a brace or a line break)."""
    if os.path.isfile(text):
        with open(text) as f:
            return f.read()
    if text and not any(mark in text for mark in "{}\n"):  # "": unset
        raise argparse.ArgumentTypeError(f"no such file: {text!r} (give a template's path, or the template itself)")
    return text


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def share(text: str) -> float:
    """A fraction of a whole, in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def byte_size(text: str) -> int:
    """``1073741824``, ``512M``, ``2GiB`` or ``1.5g`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1073741824, 512M, 2GiB)")
    return int(float(match[1]) * BYTE_UNITS[match[2]])


def secret(text: str) -> str:
    """A key: an empty one (a secret that was missing) would turn the check off without a word, so it is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a key, or leave it unset for no key")
    return text


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


class EnvFlags:
    """Adds flags to ``parser`` whose defaults ``env`` may override."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        self.parser = parser
        self.env = env

    def add(self, flag: str, type_: Callable[[str], object], default: object, help_text: str,
            secret: bool = False, **kwargs: object) -> None:
        """``--flag`` of ``type_``; a boolean flag given bare means true (``--overlap``, ``--overlap off``)."""
        name = env_name(flag)
        raw = self.env.get(name)
        if raw is not None:
            try:
                default = type_(raw)
            except (ValueError, argparse.ArgumentTypeError) as e:
                self.parser.error(f"{name}={raw!r}: {e}")
            choices = kwargs.get("choices")
            if choices is not None and default not in choices:
                self.parser.error(f"{name}={raw!r}: choose from {', '.join(map(str, choices))}")
        if type_ is boolean:
            kwargs.setdefault("nargs", "?")
            kwargs.setdefault("const", True)
        shown = f"env {name}" if secret else "default: %(default)s"
        self.parser.add_argument(flag, type=type_, default=default, help=f"{help_text} ({shown})", **kwargs)
