"""The Triton LoRA kernels against the torch update (``executor_svc/lora/layers.py``), under ``TRITON_INTERPRET=1``.

Whether triton interprets is fixed process-wide when it is first imported, so these cases live outside the suite's
collection and ``tests/test_lora_triton.py`` runs them in a child process with the variable set. Run them directly
with ``TRITON_INTERPRET=1 pytest tests/lora_triton_cases.py``.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from executor_svc.lora.layers import LoraBatch, LoraStep, LoraWeights, block_diagonal_b
from executor_svc.lora.triton_kernels import lora_add

if not isinstance(tl.sum, InterpretedFunction):
    raise RuntimeError("these cases need the triton interpreter: run them with TRITON_INTERPRET=1")

CPU = torch.device("cpu")


def projection(outputs: list[int], in_features: int, max_rank: int, ranks: list[int | None], dtype: torch.dtype,
               seed: int) -> LoraWeights:
    """A packed projection with one adapter per entry of ``ranks`` (None: an empty slot), each on every shard."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [sum(outputs[:i]) for i in range(len(outputs))]
    weights = LoraWeights(LoraStep(), list(zip(offsets, outputs, strict=True)), in_features, max_rank, False, dtype,
                          CPU)
    for slot, rank in enumerate(ranks):
        shards = [None] * len(outputs) if rank is None else [
            (torch.randn(rank, in_features, generator=gen), torch.randn(size, rank, generator=gen)) for size in outputs]
        weights.install(slot, shards, 2.0 / rank if rank else 1.0)
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs,in_features,ranks,row_slots", [
    ([40, 24, 24], 32, [8, 4], [0, -1, 1, 1, 0, -1, 0]),  # qkv-like, two adapters and base rows
    ([70], 100, [16, None, 3], [2, 2, 0, 2]),  # an empty slot between, widths past one tile
    ([33, 33], 65, [5], [-1, -1, 0]),  # gate-up-like, odd sizes
    ([64], 16, [2], [-1, -1]),  # no adapter row: nothing changes
    ([40, 24, 24], 32, [8, 4], [-1] * 3 + [0] * 10 + [1, 0, 1] + [1] * 9),  # runs through views, and segments
])
def test_triton_update_matches_torch(dtype: torch.dtype, outputs: list[int], in_features: int, ranks: list,
                                     row_slots: list[int]) -> None:
    weights = projection(outputs, in_features, 16, ranks, dtype, seed=len(row_slots))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(row_slots), in_features, generator=gen).to(dtype)
    y = torch.randn(len(row_slots), sum(outputs), generator=gen).to(dtype)
    slots = torch.tensor(row_slots)
    expected = y.clone()
    weights.step.batch = LoraBatch(slots, len(ranks), CPU)
    if weights.step.batch.slots:
        weights.add(x, expected)
    got = y.clone()
    a, bs, _, _ = weights.factors
    lora_add(x, got, a, block_diagonal_b(bs), slots.to(torch.int32))
    base = slots < 0
    assert torch.equal(got[base], y[base])  # the base model's rows are left exactly alone
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance * 10)
    assert not torch.equal(got[~base], y[~base]) or not (~base).any()  # adapter rows moved
