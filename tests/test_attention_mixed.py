"""A mixed step (decode rows beside prefill chunks, ``--scheduling-policy mixed``) as the executor packs it, through
each backend that runs on this CPU: each request's rows equal float32 SDPA over its context, in the plan's order.

The Triton kernels' case is in ``tests/triton_kernel_cases.py`` (they run under the interpreter in a child process).
"""

from __future__ import annotations

import sys

import pytest
import torch

from executor_svc.attention.cpu_backend import MIN_SPLIT_DECODES, CpuAttention
from executor_svc.attention.flash_backend import FlashAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.choice import KernelChoice
from tests.attention_helpers import MixedStep
from tests.test_attention_backends import fake_flash_attn

# (context length, query tokens) in the plan's order: a new prompt ahead of decode rows (as the planner sends new
# requests first), decode rows of short and long contexts, a 1-token prompt, later chunks after a cached prefix
# mid-block and of whole blocks, and a prompt of more query tokens than the C prefill kernel's blocks of 64.
REQUESTS = [(70, 70), (130, 1), (9, 1), (1, 1), (200, 37), (17, 1), (48, 16), (300, 1), (131, 131), (64, 1)]
HEADS = [(9, 3), (4, 1), (8, 8)]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
SCALE = 0.125


def assert_matches(step: MixedStep, out: list[torch.Tensor]) -> None:
    for i, (rows, expected) in enumerate(zip(out, step.expected(SCALE), strict=True)):
        assert rows.dtype == step.dtype
        torch.testing.assert_close(rows.float(), expected, **TOLERANCE[step.dtype],
                                   msg=lambda m, i=i: f"request {i}: {m}")


def seeded(seed: int, more_decodes: int = 0) -> list[tuple[int, int]]:
    """REQUESTS and ``more_decodes`` decode rows in a random plan order, with random context lengths for the decode
    rows."""
    gen = torch.Generator().manual_seed(seed)
    requests = REQUESTS + [(0, 1)] * more_decodes
    order = torch.randperm(len(requests), generator=gen).tolist()
    return [(int(torch.randint(1, 400, (), generator=gen)), 1) if requests[i][1] == 1 else requests[i] for i in order]


DECODES = sum(n == 1 for _, n in REQUESTS)
# The CPU backend runs a step of few decode rows whole through its prefill kernel, and splits one of more.
MORE_DECODES = {"few": 0, "many": MIN_SPLIT_DECODES - DECODES}


def test_the_step_is_mixed_and_packed_decode_rows_first() -> None:
    step = MixedStep(REQUESTS, 16, 4, 1, 64, torch.float32)
    split = step.input.meta.mixed
    assert split is not None and split.num_decodes == sum(n == 1 for _, n in REQUESTS)
    assert sorted(int(r[0]) for r, (_, n) in zip(step.rows, REQUESTS, strict=True) if n == 1) == [*range(6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_backend(dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int, seed: int) -> None:
    step = MixedStep(seeded(seed), block_size, num_heads, num_kv_heads, 64, dtype, seed)
    assert_matches(step, step.run(TorchAttention(), SCALE))


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("decodes", MORE_DECODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_backend(dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int, kernels: str,
                     decodes: str, seed: int) -> None:
    """Under either kernel choice: the C decode and prefill kernels, or torch for both halves."""
    backend = CpuAttention()
    backend.kernels = KernelChoice.uniform(kernels)
    step = MixedStep(seeded(seed, MORE_DECODES[decodes]), block_size, num_heads, num_kv_heads, 64, dtype, seed)
    assert_matches(step, step.run(backend, SCALE))


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("decodes", MORE_DECODES)
def test_cpu_backend_splits_from_enough_decode_rows(monkeypatch: pytest.MonkeyPatch, decodes: str) -> None:
    calls: list[tuple[str, int]] = []
    for name in ("kernel_decode", "kernel_prefill"):
        kernel = getattr(CpuAttention, name)
        monkeypatch.setattr(CpuAttention, name, lambda self, q, *rest, name=name, kernel=kernel: calls.append(
            (name, q.shape[0])) or kernel(self, q, *rest))
    requests = seeded(0, MORE_DECODES[decodes])
    MixedStep(requests, 16, 9, 3, 64, torch.float32).run(CpuAttention(), SCALE)
    rows, num_decodes = sum(n for _, n in requests), sum(n == 1 for _, n in requests)
    if num_decodes < MIN_SPLIT_DECODES:
        assert calls == [("kernel_prefill", rows)]
    else:
        assert calls == [("kernel_decode", num_decodes), ("kernel_prefill", rows - num_decodes)]


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler for the CPU kernels")
def test_cpu_backend_chooses_by_the_steps_longest_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few decode rows go whole through the C prefill kernel unless the table gives the step's longest context (a
    decode row's 300 tokens: ``prefill``) to torch, whatever its 5 rows' class ("2-8")."""
    calls: list[tuple[str, int]] = []
    for name in ("kernel_decode", "kernel_prefill"):
        kernel = getattr(CpuAttention, name)
        monkeypatch.setattr(CpuAttention, name, lambda self, q, *rest, name=name, kernel=kernel: calls.append(
            (name, q.shape[0])) or kernel(self, q, *rest))
    step = MixedStep([(300, 1), (20, 4)], 16, 9, 3, 64, torch.float32)
    backend = CpuAttention()
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "prefill"): "torch"})
    assert_matches(step, step.run(backend, SCALE))
    assert calls == [("kernel_decode", 1), ("kernel_prefill", 4)]  # split; the chunk's 20 tokens: "9-32", C
    calls.clear()
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "2-8"): "torch"})
    assert_matches(step, step.run(backend, SCALE))
    assert calls == [("kernel_prefill", 5)]


@pytest.mark.parametrize("seed", [0, 1])
def test_flash_backend(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """bfloat16 over pages of 256 tokens: both halves in flash-attn (a stand-in with its semantics; the store is
    Triton's, which needs a GPU, so torch stores here)."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    step = MixedStep(seeded(seed), 256, 9, 3, 64, torch.bfloat16, seed)
    assert_matches(step, step.run(FlashAttention(), SCALE, store=TorchAttention()))


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_keeps_short_chunks_beside_a_long_one_in_c(monkeypatch: pytest.MonkeyPatch,
                                                               dtype: torch.dtype) -> None:
    """A split step whose prefill half holds a chunk past 256 tokens of context (``prefill``: torch here) still runs
    the short chunks after it in one C call."""
    calls: list[tuple[str, int]] = []
    for name in ("kernel_decode", "kernel_prefill"):
        kernel = getattr(CpuAttention, name)
        monkeypatch.setattr(CpuAttention, name, lambda self, q, *rest, name=name, kernel=kernel: calls.append(
            (name, q.shape[0])) or kernel(self, q, *rest))
    requests = [(300, 280), (48, 16), (20, 20)] + [(40 + 7 * i, 1) for i in range(MIN_SPLIT_DECODES)]
    step = MixedStep(requests, 16, 9, 3, 64, dtype)
    backend = CpuAttention()
    backend.kernels = KernelChoice.uniform("c").with_ways({("prefill_attention", "prefill"): "torch"})
    assert_matches(step, step.run(backend, SCALE))
    assert calls == [("kernel_decode", MIN_SPLIT_DECODES), ("kernel_prefill", 16 + 20)]
