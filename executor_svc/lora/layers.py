"""The low-rank update of one projection for every row of a step at once, whatever adapter each row uses.

Each loaded adapter has a slot; a projection keeps every slot's factors side by side: A of all slots stacked
[slots * width, in] and B [out, slots * width], where ``width`` is the packed shards (3 for qkv, 2 for gate-up, else
1) times ``--max-lora-rank`` (a lower rank is padded with zeros). The base projection runs once over all rows; then
``y += ((x A^T) * mask) B^T``, where the step's mask (``LoraBatch``) holds, for each row, its adapter's scaling under
its own slot's columns and zeros elsewhere: one batched update for every adapter segment of the step, two GEMMs
whose inner size is the active adapters' ranks, small beside the projection's. A base row's mask row is zero, so
the update adds exactly 0.0 to it.

Tensor parallelism shards as the projection does: a column-parallel projection keeps this rank's rows of B (each
packed shard's), a row-parallel one this rank's columns of A, and its partial update is summed by the projection's
all-reduce with the rest.
"""

from __future__ import annotations

import torch

from executor_svc.runtime.distributed import tp_rank


class LoraBatch:
    """One step's rows and their adapters' slots (-1: the base model), with the masks each projection width needs."""

    def __init__(self, row_slots: torch.Tensor, scalings: dict[int, float], num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.row_slots = row_slots
        self.slots = sorted({int(s) for s in row_slots.unique().tolist()} - {-1})
        self.scalings = scalings
        self.num_slots = num_slots
        self.dtype, self.device = dtype, device
        self._columns: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def columns(self, width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The stacked columns this step reads (None: all of them, when most slots are active: no copy of the
        factors) and the mask [rows, those columns]."""
        cached = self._columns.get(width)
        if cached is not None:
            return cached
        everything = 2 * len(self.slots) >= self.num_slots
        chosen = torch.arange(self.num_slots) if everything else torch.tensor(self.slots)
        scale = torch.tensor([self.scalings.get(int(s), 0.0) for s in chosen], dtype=self.dtype)
        mask = ((self.row_slots[:, None] == chosen[None, :]) * scale).repeat_interleave(width, dim=1)
        cols = None if everything else (chosen[:, None] * width + torch.arange(width)).flatten().to(self.device)
        cached = self._columns[width] = (cols, mask.to(self.device))
        return cached


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
        self.factors = (torch.zeros(0, in_features, dtype=dtype, device=device),
                        torch.zeros(out, 0, dtype=dtype, device=device))
        # Slots holding factors for this projection: a step whose adapters all skip it adds nothing here.
        self.slots: set[int] = set()

    def install(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter's full-size (A, B) per packed shard (None: not targeted) into ``slot``."""
        a_all, b_all = self.factors
        have = a_all.shape[0] // self.width
        if slot >= have:
            grow = (slot + 1 - have) * self.width
            a_all = torch.cat([a_all, a_all.new_zeros(grow, a_all.shape[1])])
            b_all = torch.cat([b_all, b_all.new_zeros(b_all.shape[0], grow)], dim=1)
        first = slot * self.width
        a_all[first : first + self.width].zero_()
        b_all[:, first : first + self.width].zero_()
        for i, ((offset, size), pair) in enumerate(zip(self.outputs, shards, strict=True)):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, tp_rank() * self.in_features, self.in_features)
            else:
                b = b.narrow(0, tp_rank() * size, size)
            cols = first + i * self.max_rank
            a_all[cols : cols + rank].copy_(a)
            b_all[offset : offset + size, cols : cols + rank].copy_(b)
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
        """``y += ((x A^T) * mask) B^T`` for the running step's rows (``x`` [rows, in], ``y`` [rows, out])."""
        batch = self.step.batch
        if not any(slot in self.slots for slot in batch.slots):
            return
        cols, mask = batch.columns(self.width)
        a, b = self.factors
        if cols is not None:
            a, b = a.index_select(0, cols), b.index_select(1, cols)
        elif mask.shape[1] != a.shape[0]:  # an adapter loaded since the batch was made has no row in it
            a, b = a[: mask.shape[1]], b[:, : mask.shape[1]]
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, y.shape[-1])
        y2.addmm_(torch.mm(x2, a.t()).mul_(mask), b.t())
