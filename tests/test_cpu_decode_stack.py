"""The CPU decode stack (``executor_svc/cpu/decode_stack.py``): the tokens of the layer-by-layer path, on the
models and steps it fits, and that path wherever it does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.decode_stack import CpuDecodeStack
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler here to build the kernels")

PROMPTS = [[1 + i, 2, 3, 4, 5, 6, 7, 8] * (1 + i % 5) for i in range(10)]


def generate(folder: Path, dtype: str, stack: bool, monkeypatch: pytest.MonkeyPatch, kernels: str = "c",
             max_tokens: int = 24) -> tuple[list[list[int]], list[int], ModelExecutor]:
    """Greedy completions of PROMPTS (every request at once, so decode batches shrink as they finish), the row
    counts of the steps the stack ran, and the executor."""
    ran: list[int] = []
    run = CpuDecodeStack.run
    monkeypatch.setattr(CpuDecodeStack, "run", lambda self, hidden, *rest: ran.append(hidden.shape[0]) or run(
        self, hidden, *rest))
    executor = ModelExecutor(ExecutorOptions(
        model=str(folder), dtype=dtype, threads=2, kv_cache_memory=64 << 20, cpu_kernels=kernels,
        cpu_decode_stack=stack))
    engine = Engine(executor, SchedulerConfig())
    lengths = [max_tokens - i for i in range(len(PROMPTS))]
    out = engine.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert_all_blocks_free(engine.block_manager)
    return [c.token_ids for c in out], ran, executor


def decoder(executor: ModelExecutor) -> torch.nn.Module:
    return executor.runner.model.model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_gives_the_layers_tokens_on_smollm2(dtype: str, smollm2_folder: Path,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with_stack, ran, executor = generate(smollm2_folder, dtype, True, monkeypatch)
    assert decoder(executor).cpu_stack is not None
    assert set(ran) == set(range(1, len(PROMPTS) + 1)), "every decode batch size, prefills not"
    without, ran_off, executor = generate(smollm2_folder, dtype, False, monkeypatch)
    assert decoder(executor).cpu_stack is None and not ran_off
    assert with_stack == without
    assert all(len(set(tokens)) > 1 for tokens in with_stack)  # real text, not a stuck token


def test_qwen2_biases_fit_and_qwen3_norms_do_not(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2's q/k/v biases go into the stack's qkv projection, C or torch; Qwen3's q/k norms keep the layers'
    path."""
    for kernels in ("c", "c,linear=torch"):
        qwen2, ran, executor = generate(tiny_model_folders["qwen2"], "float32", True, monkeypatch, kernels)
        assert ran and decoder(executor).cpu_stack is not None
        assert qwen2 == generate(tiny_model_folders["qwen2"], "float32", False, monkeypatch, kernels)[0]
    _, ran, executor = generate(tiny_model_folders["qwen3"], "float32", True, monkeypatch)
    assert decoder(executor).cpu_stack is None and not ran


def test_rows_where_linear_runs_torch_keep_the_stack_with_torch_projections(
        tiny_model_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The kernel choice says torch for linear at 2-8 rows: those steps run the stack with each projection in
    torch, the rest the whole stack in C, and the tokens are those of the choice without the stack."""
    kernels, torch_rows = "c,linear:2-8=torch", []
    run_torch = CpuDecodeStack._run_torch_linears
    monkeypatch.setattr(CpuDecodeStack, "_run_torch_linears", lambda self, hidden, residual: torch_rows.append(
        hidden.shape[0]) or run_torch(self, hidden, residual))
    tokens, ran, _ = generate(tiny_model_folders["llama"], "float32", True, monkeypatch, kernels, max_tokens=40)
    assert set(ran) == set(range(1, len(PROMPTS) + 1))
    assert set(torch_rows) == set(range(2, 9))
    assert tokens == generate(tiny_model_folders["llama"], "float32", False, monkeypatch, kernels, max_tokens=40)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_in_torch_everywhere_drops_the_packed_copies_and_keeps_the_stack(
        dtype: str, smollm2_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """As a Xeon with AMX may choose: no C linear at any row count, so no packed weights to point the whole
    stack at, yet every decode step still runs its C parts in the stack, with the layers' tokens."""
    with_stack, ran, executor = generate(smollm2_folder, dtype, True, monkeypatch, "c,linear=torch")
    model = decoder(executor)
    assert model.cpu_stack is not None and not model.cpu_stack.packed
    assert all(layer.self_attn.qkv_proj.packed_weight is None for layer in model.layers)
    assert set(ran) == set(range(1, len(PROMPTS) + 1))
    assert with_stack == generate(smollm2_folder, dtype, False, monkeypatch, "c,linear=torch")[0]


def test_rows_where_attention_or_norm_runs_torch_take_the_layers(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode attention or RMSNorm in torch at 2-8 rows: those steps run layer by layer, the rest stacked."""
    for kernels in ("c,decode_attention:2-8=torch", "c,rms_norm:2-8=torch"):
        tokens, ran, _ = generate(tiny_model_folders["llama"], "float32", True, monkeypatch, kernels, max_tokens=40)
        assert ran and all(rows == 1 or rows > 8 for rows in ran)
        assert tokens == generate(tiny_model_folders["llama"], "float32", False, monkeypatch, kernels,
                                  max_tokens=40)[0]


def test_the_torch_attention_backend_keeps_the_layers(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(model=str(tiny_model_folders["llama"]), dtype="float32", threads=2,
                                             kv_cache_memory=16 << 20, attention_backend="torch"))
    assert decoder(executor).cpu_stack is None


@pytest.mark.parametrize("kernels", ["c", "c,linear=torch"])
def test_a_position_or_slot_outside_is_an_error_not_a_write(kernels: str, tiny_model_folders: dict[str, Path],  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, executor = generate(tiny_model_folders["llama"], "float32", True, monkeypatch, kernels, max_tokens=12)
    model = decoder(executor)
    stack, cache = model.cpu_stack, model.layers[0].self_attn.attn.k_cache
    meta = type("Meta", (), {})()
    meta.is_prefill, meta.block_tables = False, torch.zeros(1, 1, dtype=torch.int32)
    meta.context_lens, meta.slot_mapping = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    hidden = torch.randn(1, model.norm.weight.shape[0])
    with pytest.raises(IndexError, match="rotary"):
        stack.run(hidden.clone(), torch.tensor([10**6]), meta)
    before = cache.clone()
    meta.slot_mapping = torch.tensor([cache.shape[0] * cache.shape[1]])
    with pytest.raises(IndexError, match="slot"):
        stack.run(hidden.clone(), torch.zeros(1, dtype=torch.int64), meta)
    assert torch.equal(cache, before)
