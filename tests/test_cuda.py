"""On a CUDA device: every attention backend, CUDA graphs, and the kernels compiled for real.

Skipped where there is no GPU (CI); ``bench/gpu_check.sh`` runs it when one is lent. The
interpreted Triton cases (tests/triton_kernel_cases.py) check the kernels' logic on the CPU;
these check what only a GPU build shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.attention import available_backends
from executor_svc.attention.flash_backend import FLASH_PAGE_MULTIPLE
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import hf_greedy, tiny_model_folders  # noqa: F401
from tests.test_model_parity import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
NEW_TOKENS = 32


def cuda_tokens(folder: Path, backend: str, dtype: str, enforce_eager: bool, block_size: int = 16,
                scheduler: SchedulerConfig | None = None) -> list[list[int]]:
    options = ExecutorOptions(
        model=str(folder), device="cuda", dtype=dtype, attention_backend=backend, block_size=block_size,
        kv_cache_memory=256 << 20, enforce_eager=enforce_eager,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [c.token_ids for c in Engine(ModelExecutor(options), scheduler).generate(random_prompts(7), params)]


def backends() -> list[str]:
    return available_backends(CUDA) if torch.cuda.is_available() else []


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_float32_greedy_matches_hf(tiny_model_folders: dict[str, Path], family: str, backend: str) -> None:  # noqa: F811
    """Float32 on the GPU (TF32 off, torch's default) gives transformers' CPU tokens, eager and with graphs."""
    folder = tiny_model_folders[family]
    expected = hf_greedy(folder, random_prompts(7), NEW_TOKENS, stop_at_eos=False)
    assert cuda_tokens(folder, backend, "float32", enforce_eager=True) == expected
    assert cuda_tokens(folder, backend, "float32", enforce_eager=False) == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_policy_float32_greedy_matches_hf(tiny_model_folders: dict[str, Path], backend: str) -> None:  # noqa: F811
    """Mixed steps (decode rows through the paged decode kernel beside prefill chunks) run eagerly and pure decode
    steps on graphs: still transformers' tokens."""
    folder = tiny_model_folders["llama"]
    expected = hf_greedy(folder, random_prompts(7), NEW_TOKENS, stop_at_eos=False)
    mixed = SchedulerConfig(max_num_batched_tokens=24, policy="mixed")
    assert cuda_tokens(folder, backend, "float32", enforce_eager=False, scheduler=mixed) == expected


@pytest.mark.parametrize("backend", backends())
def test_cuda_graphs_give_the_eager_tokens_in_bfloat16(tiny_model_folders: dict[str, Path], backend: str) -> None:  # noqa: F811
    """Replaying captured decode graphs changes nothing; flash-attn's paged path needs pages of 256."""
    block_size = FLASH_PAGE_MULTIPLE if backend == "flash_attn" else 16
    folder = tiny_model_folders["qwen3"]
    eager = cuda_tokens(folder, backend, "bfloat16", enforce_eager=True, block_size=block_size)
    assert cuda_tokens(folder, backend, "bfloat16", enforce_eager=False, block_size=block_size) == eager



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_steps_launched_behind_the_step_before_give_transformers_tokens(
    tiny_model_folders: dict[str, Path], backend: str,  # noqa: F811
) -> None:
    """With overlap and two plans ahead, a greedy decode step's tokens stay on the device for the step launched
    behind it, whose graph replay is queued before the host has them: still transformers' tokens."""
    folder = tiny_model_folders["llama"]
    expected = hf_greedy(folder, random_prompts(7), NEW_TOKENS, stop_at_eos=False)
    executor = ModelExecutor(ExecutorOptions(model=str(folder), device="cuda", dtype="float32",
                                             attention_backend=backend, kv_cache_memory=256 << 20))
    launch, launched_behind = executor.launch, []

    def noting(chunks, inputs=None, sampled_before=None, behind=None):
        launched_behind.append(behind is not None)
        return launch(chunks, inputs, sampled_before, behind)

    executor.launch = noting
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = Engine(executor, overlap=True, plans_ahead=2)
    assert [c.token_ids for c in engine.generate(random_prompts(7), params)] == expected
    assert any(launched_behind), "some decode step was launched behind the one before"


def test_seeded_draws_launched_behind_the_step_before_are_the_draws_made_after_it(
    tiny_model_folders: dict[str, Path],  # noqa: F811
) -> None:
    """Seeded rows drawn at launch, each step queued behind the one before, against the same rows drawn once each
    step was waited for: the same tokens (float32, graphs)."""
    folder = tiny_model_folders["qwen3"]
    params = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for on_device in (False, True):
        executor = ModelExecutor(ExecutorOptions(model=str(folder), device="cuda", dtype="float32",
                                                 kv_cache_memory=256 << 20))
        if not on_device:
            executor.runner.samples_on_device = lambda model_input, runs: False
        engine = Engine(executor, overlap=True, plans_ahead=2)
        runs.append([c.token_ids for c in engine.generate(random_prompts(7), params)])
    assert runs[0] == runs[1]
