"""The low-rank update of one projection for every row of a step at once, whatever adapter each row uses.

Each loaded adapter has a slot; a projection keeps every slot's factors stacked: A [slots, in, width] and B [slots,
width, out], where ``width`` is the packed shards (3 for qkv, 2 for gate-up, else 1) times ``--max-lora-rank`` (a
lower rank is padded with zeros) and B is block-diagonal over the shards. The base projection runs once over all rows;
then the step's adapter rows are gathered into one segment per adapter ([adapters, rows, in], ``LoraBatch``), each
segment is multiplied by its own adapter's A, scaled, and by its B in two batched GEMMs, and the products are added
to their rows. Where the adapter rows come in a few runs of consecutive rows (a prefill's chunks, each one request's),
each run is updated in place through views instead, without the gathering and scattering that cost more than the
GEMMs at prefill's row counts. A row of the base model is in no segment or run: its output is the base
projection's, bit for bit.

Tensor parallelism shards as the projection does: a column-parallel projection keeps this rank's rows of B (each
packed shard's), a row-parallel one this rank's columns of A, and its partial update is summed by the projection's
all-reduce with the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.runtime.distributed import tp_rank


class LoraBatch:
    """One step's adapter rows as runs of consecutive rows (``runs``), or else as segments: ``gather`` [adapters, rows]
    (short segments padded with row 0, whose products are dropped), the rows each product goes to (``targets``, and
    which products those are: ``kept``, None when none is padding), the segments' slots (``slot_index``;
    ``every_slot``: slots 0.. in order, whose factors need no gathering) and their adapters' scalings [adapters, 1,
    1]."""

    def __init__(self, row_slots: torch.Tensor, scalings: dict[int, float], num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        slots = sorted({int(s) for s in row_slots.unique().tolist()} - {-1})
        self.slots = slots
        self.runs = _runs(row_slots, scalings, len(slots))
        rows = [torch.nonzero(row_slots == slot).flatten() for slot in slots]
        length = max((len(r) for r in rows), default=0)
        gather = torch.zeros(len(slots), length, dtype=torch.int64)
        for i, r in enumerate(rows):
            gather[i, : len(r)] = r
        counts = torch.tensor([len(r) for r in rows])
        valid = (torch.arange(length)[None, :] < counts[:, None]).flatten()
        self.gather = gather.flatten().to(device)
        self.targets = self.gather[valid.to(device)]
        self.kept = None if bool(valid.all()) else torch.nonzero(valid).flatten().to(device)
        self.slot_index = torch.tensor(slots, device=device)
        self.every_slot = slots == list(range(num_slots))
        self.scales = torch.tensor([scalings[s] for s in slots], dtype=dtype, device=device).view(-1, 1, 1)
        self.length = length
        # On CUDA with Triton: its kernels, which take each row's slot and every slot's scaling instead.
        self.kernel = cuda_kernel() if device.type == "cuda" else None
        if self.kernel is not None:
            self.row_slots = row_slots.to(device=device, dtype=torch.int32)
            self.slot_scales = torch.tensor([scalings.get(s, 0.0) for s in range(num_slots)], dtype=torch.float32,
                                            device=device)


def _runs(row_slots: torch.Tensor, scalings: dict[int, float], num_adapters: int
          ) -> list[tuple[int, int, int, float]] | None:
    """The adapter rows as (start, end, slot, scaling) runs of consecutive rows where they are few (a prefill's
    chunks: each is one request's), updated in place through views; None where adapters interleave (decode rows),
    which take the gathered segments."""
    change = torch.nonzero(row_slots[1:] != row_slots[:-1]).flatten() + 1
    starts = [0, *change.tolist()]
    if len(starts) > 2 * num_adapters + 1:
        return None
    ends = [*starts[1:], len(row_slots)]
    slots = row_slots[starts].tolist()
    return [(start, end, slot, scalings[slot]) for start, end, slot in zip(starts, ends, slots, strict=True)
            if slot >= 0]


def cuda_kernel() -> Callable[..., None] | None:
    """``triton_kernels.lora_add`` where Triton is installed."""
    try:
        from executor_svc.lora.triton_kernels import lora_add
    except ImportError:
        return None
    return lora_add


class LoraStep:
    """The batch of the step running now, shared by every adapted projection of the model (None: no adapter row,
    and the projections run exactly as without LoRA)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraWeights:
    """Every slot's factors for one projection. ``outputs``: (offset, size) of each packed shard in this rank's
    output; ``row_parallel``: the projection splits its input across ranks instead."""

    def __init__(self, step: LoraStep, outputs: list[tuple[int, int]], in_features: int, max_rank: int,
                 row_parallel: bool, dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.outputs = outputs
        self.in_features = in_features
        self.max_rank = max_rank
        self.row_parallel = row_parallel
        self.width = len(outputs) * max_rank
        out = sum(size for _, size in outputs)
        # Replaced whole (never resized in place) when a slot is added, so a forward reads one consistent pair.
        self.factors = (torch.zeros(0, in_features, self.width, dtype=dtype, device=device),
                        torch.zeros(0, self.width, out, dtype=dtype, device=device))
        # Slots holding factors for this projection: a step whose adapters all skip it adds nothing here.
        self.slots: set[int] = set()

    def install(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter's full-size (A, B) per packed shard (None: not targeted) into ``slot``."""
        a_all, b_all = self.factors
        if slot >= a_all.shape[0]:
            grow = slot + 1 - a_all.shape[0]
            a_all = torch.cat([a_all, a_all.new_zeros(grow, *a_all.shape[1:])])
            b_all = torch.cat([b_all, b_all.new_zeros(grow, *b_all.shape[1:])])
        a_all[slot].zero_()
        b_all[slot].zero_()
        for i, ((offset, size), pair) in enumerate(zip(self.outputs, shards, strict=True)):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, tp_rank() * self.in_features, self.in_features)
            else:
                b = b.narrow(0, tp_rank() * size, size)
            first = i * self.max_rank
            a_all[slot, :, first : first + rank].copy_(a.t())
            b_all[slot, first : first + rank, offset : offset + size].copy_(b.t())
        self.factors = (a_all, b_all)
        if any(pair is not None for pair in shards):
            self.slots.add(slot)
        else:
            self.slots.discard(slot)

    def remove(self, slot: int) -> None:
        """Zero ``slot``'s factors (no request uses it any more)."""
        if slot in self.slots:
            self.install(slot, [None] * len(self.outputs))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += scaling * (x[rows] A^T) B^T`` for each adapter's rows of the running step (``x`` [rows, in],
        ``y`` [rows, out])."""
        batch = self.step.batch
        if not any(slot in self.slots for slot in batch.slots):
            return
        a, b = self.factors
        if batch.kernel is not None:
            batch.kernel(x.reshape(-1, self.in_features), y.view(-1, y.shape[-1]), a, b, batch.row_slots,
                         batch.slot_scales[: a.shape[0]])
            return
        if batch.runs is not None:
            x2, y2 = x.reshape(-1, self.in_features), y.view(-1, y.shape[-1])
            for start, end, slot, scaling in batch.runs:
                y2[start:end].addmm_(torch.mm(x2[start:end], a[slot]).mul_(scaling), b[slot])
            return
        if not batch.every_slot or a.shape[0] != len(batch.slots):
            a, b = a.index_select(0, batch.slot_index), b.index_select(0, batch.slot_index)
        segments = x.reshape(-1, self.in_features).index_select(0, batch.gather)
        shrunk = torch.bmm(segments.view(len(batch.slots), batch.length, -1), a).mul_(batch.scales)
        products = torch.bmm(shrunk, b).view(-1, b.shape[-1])
        if batch.kept is not None:
            products = products.index_select(0, batch.kept)
        y.view(-1, y.shape[-1]).index_add_(0, batch.targets, products)
