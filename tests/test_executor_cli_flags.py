"""Executor flags a machine or model cannot run end the start with one line naming the flag, before a weight is read,
not with a traceback from inside the model's loading; --gpu-memory-utilization is a share, as vLLM's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc.__main__ import build_parser, main

# The least config.json the executor reads: a Qwen3 of 64 positions (no weights: the checks come before them).
TINY_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 64}


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


def start_error(argv: list[str]) -> str:
    """The one line an executor started with ``argv`` ends with (main's exit message)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    message = exit_.value.code
    assert isinstance(message, str), f"not an error exit: {message!r}"
    assert len(message.splitlines()) == 1 and message.startswith("nanoserve-executor: error: "), message
    return message


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "nan"])
def test_gpu_memory_utilization_outside_0_to_1_is_refused_naming_the_flag(value: str,
                                                                         capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["--gpu-memory-utilization", value])
    assert "--gpu-memory-utilization" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser({"NANOSERVE_GPU_MEMORY_UTILIZATION": value})
    assert "NANOSERVE_GPU_MEMORY_UTILIZATION" in capsys.readouterr().err
    assert build_parser({}).parse_args(["--gpu-memory-utilization", "1"]).gpu_memory_utilization == 1


@pytest.mark.parametrize(("device", "says"), [
    ("bogus", "is not a device"),
    ("mps", "runs on cpu or cuda only"),
    ("cuda:99", "--device 'cuda:99'"),  # no such GPU, on a machine with GPUs or none
])
def test_a_device_the_executor_cannot_run_on_is_refused_naming_the_flag(device: str, says: str, model: str):
    error = start_error(["--model", model, "--device", device])
    assert "--device" in error and says in error


@pytest.mark.parametrize(("backend", "says"), [("bogus", "is not a backend"), ("flash_attn", "not available on cpu")])
def test_an_attention_backend_the_device_cannot_run_is_refused_naming_the_flag(backend: str, says: str, model: str):
    error = start_error(["--model", model, "--device", "cpu", "--attention-backend", backend])
    assert "--attention-backend" in error and says in error


def test_a_max_model_len_past_the_models_is_refused_naming_the_flag(model: str):
    error = start_error(["--model", model, "--device", "cpu", "--max-model-len", "65"])
    assert "--max-model-len 65" in error and "max_position_embeddings 64" in error


def test_a_model_that_is_not_there_is_refused_naming_the_flag(tmp_path: Path):
    assert "--model" in start_error(["--model", str(tmp_path / "missing"), "--device", "cpu"])


def test_the_process_exits_non_zero_with_one_line(model: str):
    done = subprocess.run([sys.executable, "-m", "executor_svc", "--model", model, "--device", "bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["nanoserve-executor: error: --device 'bogus' is not a device; give "
                                                "cpu, cuda or cuda:N"]
