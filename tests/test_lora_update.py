"""The CPU LoRA update of one packed projection (``executor_svc/lora/layers.py``) against each row's own adapter
computed alone: prefill runs through views and interleaved decode rows through segments in one step, adapters of
lower rank or on some shards only, an unloaded slot, a window of the step's rows (``LlamaMLP``'s row chunks), and the
base model's rows left exactly alone."""

from __future__ import annotations

import pytest
import torch

from executor_svc.lora.layers import MIN_RUN, LoraBatch, LoraStep, LoraWeights

CPU = torch.device("cpu")
OUTPUTS = [40, 24, 24]  # a qkv-like projection's shards
IN_FEATURES, MAX_RANK = 32, 8
# slot -> (rank, targeted shards, scaling); slot 2 is loaded, then unloaded
ADAPTERS = {0: (8, [0, 1, 2], 2.0), 1: (3, [0, 2], 0.75), 2: (4, [1], 1.5), 3: (8, [1, 2], 0.5)}


def projection() -> tuple[LoraWeights, dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]]]:
    gen = torch.Generator().manual_seed(1)
    offsets = [sum(OUTPUTS[:i]) for i in range(len(OUTPUTS))]
    weights = LoraWeights(LoraStep(), list(zip(offsets, OUTPUTS, strict=True)), IN_FEATURES, MAX_RANK, False,
                          torch.float32, CPU)
    factors = {}
    for slot, (rank, shards, scaling) in ADAPTERS.items():
        factors[slot] = [(torch.randn(rank, IN_FEATURES, generator=gen), torch.randn(size, rank, generator=gen))
                         if i in shards else None for i, size in enumerate(OUTPUTS)]
        weights.install(slot, factors[slot], scaling)
    weights.remove(2)
    del factors[2]
    return weights, factors


def reference(x: torch.Tensor, y: torch.Tensor, row_slots: list[int], factors: dict) -> torch.Tensor:
    """Each adapter row's update alone, as PEFT computes it: scaling * B (A x), shard by shard."""
    out = y.clone()
    for row, slot in enumerate(row_slots):
        if slot not in factors:
            continue
        offset = 0
        for size, pair in zip(OUTPUTS, factors[slot], strict=True):
            if pair is not None:
                a, b = pair
                out[row, offset : offset + size] += ADAPTERS[slot][2] * (b @ (a @ x[row]))
            offset += size
    return out


# A prefill chunk of each adapter, decode rows of every adapter interleaved with the base model's, a short run, and a
# row of the unloaded slot 2 (which a step never names: it must change nothing).
ROW_SLOTS = ([-1] * 3 + [0] * MIN_RUN + [1] * (MIN_RUN + 5) + [3, -1, 0, 1, 1, 3, 0, -1] + [3] * (MIN_RUN - 1)
             + [2, -1] + [3] * (MIN_RUN + 2))


@pytest.mark.parametrize("window", [None, (5, 27), (20, len(ROW_SLOTS))], ids=["step", "window", "tail"])
def test_each_row_gets_its_own_adapters_update(window: tuple[int, int] | None) -> None:
    weights, factors = projection()
    gen = torch.Generator().manual_seed(2)
    row_slots = torch.tensor(ROW_SLOTS)
    batch = LoraBatch(row_slots, len(ADAPTERS), CPU)
    assert batch.runs and batch.gather is not None  # both ways in one step
    start, end = window or (0, len(ROW_SLOTS))
    x = torch.randn(end - start, IN_FEATURES, generator=gen)
    y = torch.randn(end - start, sum(OUTPUTS), generator=gen)
    expected = reference(x, y, ROW_SLOTS[start:end], factors)
    got = y.clone()
    weights.step.batch = batch
    with weights.step.rows(start, end):
        weights.add(x, got)
    assert weights.step.batch is batch
    untouched = torch.tensor([s not in factors for s in ROW_SLOTS[start:end]])
    assert torch.equal(got[untouched], y[untouched])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[~untouched], y[~untouched])
