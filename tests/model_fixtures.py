"""Model fixtures: the embedded SmolLM2 folder and tiny random-weight Llama/Qwen2/Qwen3 folders.

Import the fixtures you use into a test module (``from tests.model_fixtures import ...``).
Everything here is session-scoped: each model is built or converted once per run.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from common.step import SamplingSettings  # noqa: E402
from executor_svc.core.request_table import RequestState, ScheduledChunk  # noqa: E402
from executor_svc.runtime.model_input import prepare_input  # noqa: E402
from executor_svc.runtime.registry import DEFAULT_MODEL, resolve_model  # noqa: E402

if TYPE_CHECKING:
    from executor_svc.runtime.model_runner import ModelRunner

T = TypeVar("T")

TINY_VOCAB = 512
_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_CONFIGS = {
    # Tied embeddings, head_dim from hidden_size / heads.
    "llama": lambda: LlamaConfig(**_TINY_COMMON, tie_word_embeddings=True, rope_theta=10000.0),
    # q/k/v biases, untied LM head.
    "qwen2": lambda: Qwen2Config(**_TINY_COMMON, tie_word_embeddings=False, rope_theta=1000000.0),
    # q/k RMSNorm and a head_dim (32) that is not hidden_size / heads (16).
    "qwen3": lambda: Qwen3Config(**_TINY_COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
}


def save_tiny_model(name: str, folder: Path, seed: int = 0) -> Path:
    """A random-weight model of family ``name`` saved as a Hugging Face folder (float32 safetensors)."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random biases and norm weights, so a loader that drops or misplaces them changes the tokens.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in param_name else torch.randn_like(param))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"llama" | "qwen2" | "qwen3": folder} of tiny random-weight models."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(name, root / name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into $NANOSERVE_CACHE (or ~/.cache/nanoserve)."""
    return resolve_model(DEFAULT_MODEL)


def in_spinning_process(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` in a fresh process whose OpenMP threads wait spinning, as by default, unless workers share
    the cores.

    The suite's processes wait passively (conftest.py), which suits its many small services sharing two cores (the
    whole suite ran longer with the executor's brief spin) but wakes the threads by a system call at each op: a lone
    real model's float32 steps, hundreds of small ops each, run about twice as fast spinning
    (docs/benchmarks-history.md, "The suite's OpenMP wait"). ``function`` must be importable by name (a module-level
    function), its arguments and result picklable. Where other pytest-xdist workers share the cores (``make test``),
    spinning threads would spend their turns: ``function`` runs here, passively, instead."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        return function(*args)
    saved = os.environ.pop("OMP_WAIT_POLICY", None)  # the child takes this process's environment as it starts
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(function, *args).result()
    finally:
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool) -> list[list[int]]:
    """Hugging Face transformers' greedy completions, one prompt at a time (the reference), in float32."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.generation_config
    if not stop_at_eos:
        config.eos_token_id = None
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, generation_config=config
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def teacher_forced_logits(runner: ModelRunner, sequences: list[list[int]], prompt_lengths: list[int]
                          ) -> list[torch.Tensor]:
    """Each sequence's float32 logits at every position but its last ([len - 1, vocab]), fed its own tokens whatever
    the model predicts, so that two runners are compared on the same inputs even where their greedy tokens part.

    Steps as the engine runs a batch: every prompt prefilled in one step, then decode steps of one token for every
    sequence not yet at its end."""
    width = -(-max(map(len, sequences)) // runner.block_size)
    assert len(sequences) * width <= runner.num_blocks, "the KV cache holds too few blocks for these sequences"
    states = [RequestState(i, list(tokens), list(range(i * width, (i + 1) * width)), 0, SamplingSettings(), length)
              for i, (tokens, length) in enumerate(zip(sequences, prompt_lengths, strict=True))]
    chunks = [ScheduledChunk(state, 0, length) for state, length in zip(states, prompt_lengths, strict=True)]
    logits = runner.execute(prepare_input(chunks, runner.block_size, list(range(sum(prompt_lengths))))).float()
    rows: list[list[torch.Tensor]] = [[part] for part in logits.split(prompt_lengths)]
    for step in range(max(len(s) - n for s, n in zip(sequences, prompt_lengths, strict=True)) - 1):
        live = [i for i, state in enumerate(states) if state.num_prompt_tokens + step < len(state.token_ids) - 1]
        chunks = [ScheduledChunk(states[i], states[i].num_prompt_tokens + step, 1) for i in live]
        logits = runner.execute(prepare_input(chunks, runner.block_size, list(range(len(chunks))))).float()
        for row, i in enumerate(live):
            rows[i].append(logits[row : row + 1])
    return [torch.cat(parts) for parts in rows]
