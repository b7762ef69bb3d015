"""The low-rank update of one projection for every row of a step at once, whatever adapter each row uses.

Each loaded adapter has a slot; a projection keeps every slot's factors stacked: A [slots, in, width], where ``width``
is the packed shards (3 for qkv, 2 for gate-up, else 1) times ``--max-lora-rank`` (a lower rank is padded with zeros),
and each shard's B [slots, max rank, shard's out], with the adapter's scaling multiplied in once at load (a packed
projection's B kept whole would be block-diagonal: mostly zeros to multiply and stream). The base projection runs
once over all rows; the step's adapter rows then go one of two ways, sorted out once per step for every projection
(``LoraBatch``):

- runs of at least ``MIN_RUN`` consecutive rows of one adapter (a prefill chunk is one request's): each run through
  views, multiplied by its adapter's A, then by each targeted shard's B at the adapter's own rank, and added in place,
  with no gathering or scattering, which cost more than these GEMMs at prefill's row counts;
- the other rows (decode rows, where adapters interleave): gathered into one segment per adapter ([adapters, rows,
  in]), multiplied by the segments' As in one batched GEMM and by each shard's Bs in another, and added to their
  rows: a few calls whatever the adapters, fewer than a call per adapter and shard, which cost more at decode's row
  counts.

On CUDA the Triton kernels (``triton_kernels``) take every row at once, through the block-diagonal B
(``block_diagonal_b``), kept beside the shards' there. A row of the base model is in no run or segment: its output
is the base projection's, bit for bit.

Tensor parallelism shards as the projection does: a column-parallel projection keeps this rank's rows of B (each
packed shard's), a row-parallel one this rank's columns of A, and its partial update is summed by the projection's
all-reduce with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from executor_svc.runtime.distributed import tp_rank

# The shortest run of one adapter's consecutive rows updated through views; shorter ones join the gathered segments.
MIN_RUN = 8


class LoraBatch:
    """One step's adapter rows, from each row's slot (``row_slots``, -1: the base model): the ``runs`` updated through
    views, (start, end, slot) each, and the rest as segments: ``gather`` [adapters, rows] (short segments padded with
    their first row, whose extra products are dropped), the rows each product goes to (``targets``, and which products
    those are: ``kept``, None when none is padding), the segments' slots (``slot_index``; ``every_slot``: slots 0..
    in order, whose factors need no gathering); ``gather`` is None when every adapter row is in a run."""

    def __init__(self, row_slots: torch.Tensor, num_slots: int, device: torch.device) -> None:
        self.row_slots, self.num_slots, self.device = row_slots, num_slots, device
        self.slots = {int(s) for s in row_slots.unique().tolist()} - {-1}
        self._windows: dict[tuple[int, int], LoraBatch] = {}
        # On CUDA with Triton: its kernels, which take each row's slot instead.
        self.kernel = cuda_kernel() if device.type == "cuda" else None
        if self.kernel is not None:
            self.device_slots = row_slots.to(device=device, dtype=torch.int32)
            self.runs, self.gather = [], None
            return
        self.runs, in_runs = _runs(row_slots)
        rest = row_slots.masked_fill(in_runs, -1) if self.runs else row_slots
        self._segments(rest, num_slots)

    def _segments(self, row_slots: torch.Tensor, num_slots: int) -> None:
        slots = sorted({int(s) for s in row_slots.unique().tolist()} - {-1})
        if not slots:
            self.gather = None
            return
        rows = [torch.nonzero(row_slots == slot).flatten() for slot in slots]
        length = max(len(r) for r in rows)
        gather = torch.empty(len(slots), length, dtype=torch.int64)
        for i, r in enumerate(rows):
            gather[i, : len(r)] = r
            gather[i, len(r) :] = r[0]
        counts = torch.tensor([len(r) for r in rows])
        valid = (torch.arange(length)[None, :] < counts[:, None]).flatten()
        self.gather = gather.flatten().to(self.device)
        self.targets = self.gather[valid.to(self.device)]
        self.kept = None if bool(valid.all()) else torch.nonzero(valid).flatten().to(self.device)
        self.slot_index = torch.tensor(slots, device=self.device)
        self.every_slot = slots == list(range(num_slots))
        self.num_segments, self.length = len(slots), length

    def window(self, start: int, end: int) -> LoraBatch:
        """Rows [start, end) alone, as a projection over just those rows sees them (``LlamaMLP``'s row chunks); the
        same for every layer, so made once."""
        key = start, end
        if key not in self._windows:
            self._windows[key] = LoraBatch(self.row_slots[start:end], self.num_slots, self.device)
        return self._windows[key]


def _runs(row_slots: torch.Tensor) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """The runs of at least ``MIN_RUN`` consecutive rows of one adapter, and a mask of their rows."""
    change = torch.nonzero(row_slots[1:] != row_slots[:-1]).flatten() + 1
    starts = [0, *change.tolist()]
    ends = [*starts[1:], len(row_slots)]
    runs = [(start, end, slot) for start, end, slot in zip(starts, ends, row_slots[starts].tolist(), strict=True)
            if slot >= 0 and end - start >= MIN_RUN]
    in_runs = torch.zeros(len(row_slots), dtype=torch.bool)
    for start, end, _ in runs:
        in_runs[start:end] = True
    return runs, in_runs


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

    @contextmanager
    def rows(self, start: int, end: int) -> Iterator[None]:
        """While the projections run over rows [start, end) of the step only (a chunk of them)."""
        batch = self.batch
        if batch is None:
            yield
            return
        self.batch = batch.window(start, end)
        try:
            yield
        finally:
            self.batch = batch


# One targeted shard of a slot, for the runs: (its columns of the shrunk rows, its B, its output columns).
Block = tuple[slice, torch.Tensor, slice]


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
        # (A [slots, in, width]; B per shard, [slots, max_rank, size] each; the block-diagonal B [slots, width, out]
        # that the Triton kernels read, on CUDA only; each slot's targeted blocks, for the runs), replaced whole
        # (never resized in place) when a slot is added, so that a forward reads one consistent set.
        self.factors: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, dict[int, list[Block]]] = (
            torch.zeros(0, in_features, self.width, dtype=dtype, device=device),
            [torch.zeros(0, max_rank, size, dtype=dtype, device=device) for _, size in outputs], None, {})
        # Slots holding factors for this projection: a step whose adapters all skip it adds nothing here.
        self.slots: set[int] = set()
        # Each such slot's targeted shards: (shard, rank).
        self._ranks: dict[int, list[tuple[int, int]]] = {}

    def install(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float = 1.0
                ) -> None:
        """Put one adapter's full-size (A, B) per packed shard (None: not targeted) into ``slot``, B times
        ``scaling``."""
        a_all, b_all, _, _ = self.factors
        if slot >= a_all.shape[0]:
            grow = slot + 1 - a_all.shape[0]
            a_all = torch.cat([a_all, a_all.new_zeros(grow, *a_all.shape[1:])])
            b_all = [torch.cat([b, b.new_zeros(grow, *b.shape[1:])]) for b in b_all]
        a_all[slot].zero_()
        for b in b_all:
            b[slot].zero_()
        ranks = []
        for i, ((_, size), pair) in enumerate(zip(self.outputs, shards, strict=True)):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, tp_rank() * self.in_features, self.in_features)
            else:
                b = b.narrow(0, tp_rank() * size, size)
            a_all[slot, :, i * self.max_rank : i * self.max_rank + rank].copy_(a.t())
            b_all[i][slot, :rank].copy_(b.t().float() * scaling)
            ranks.append((i, rank))
        if ranks:
            self._ranks[slot] = ranks
            self.slots.add(slot)
        else:
            self._ranks.pop(slot, None)
            self.slots.discard(slot)
        # Views of these Bs (reallocated above when they grew) for every slot.
        blocks = {s: [(slice(i * self.max_rank, i * self.max_rank + rank), b_all[i][s, :rank],
                       slice(self.outputs[i][0], sum(self.outputs[i]))) for i, rank in held]
                  for s, held in self._ranks.items()}
        block_diagonal = block_diagonal_b(b_all) if a_all.device.type == "cuda" else None
        self.factors = (a_all, b_all, block_diagonal, blocks)

    def remove(self, slot: int) -> None:
        """Zero ``slot``'s factors (no request uses it any more)."""
        if slot in self.slots:
            self.install(slot, [None] * len(self.outputs))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] A) B`` for each adapter's rows of the running step (``x`` [rows, in], ``y`` [rows,
        out]; the scaling is in B)."""
        batch = self.step.batch
        if self.slots.isdisjoint(batch.slots):
            return
        a, bs, block_diagonal, blocks = self.factors
        x, y = x.reshape(-1, self.in_features), y.view(-1, y.shape[-1])
        if batch.kernel is not None:
            batch.kernel(x, y, a, block_diagonal, batch.device_slots)
            return
        for start, end, slot in batch.runs:
            targeted = blocks.get(slot)
            if targeted is None:
                continue
            shrunk, rows = torch.mm(x[start:end], a[slot]), y[start:end]
            for columns, b, outputs in targeted:
                rows[:, outputs].addmm_(shrunk[:, columns], b)
        if batch.gather is None:
            return
        if not batch.every_slot or a.shape[0] != batch.num_segments:
            a, bs = a.index_select(0, batch.slot_index), [b.index_select(0, batch.slot_index) for b in bs]
        segments = x.index_select(0, batch.gather).view(batch.num_segments, batch.length, -1)
        shrunk = torch.bmm(segments, a)
        if len(bs) == 1:
            products = torch.bmm(shrunk, bs[0])
        else:  # each shard's columns of the shrunk rows by its own B: none of a packed B's zero blocks
            rank = self.max_rank
            products = torch.cat([torch.bmm(shrunk[:, :, i * rank : (i + 1) * rank], b) for i, b in enumerate(bs)],
                                 dim=2)
        products = products.view(-1, y.shape[-1])
        if batch.kept is not None:
            products = products.index_select(0, batch.kept)
        y.index_add_(0, batch.targets, products)


def block_diagonal_b(bs: list[torch.Tensor]) -> torch.Tensor:
    """The shards' Bs ([slots, rank, size] each) as one B [slots, shards * rank, out], zero off the diagonal."""
    slots, rank = bs[0].shape[:2]
    packed = bs[0].new_zeros(slots, len(bs) * rank, sum(b.shape[2] for b in bs))
    offset = 0
    for i, b in enumerate(bs):
        packed[:, i * rank : (i + 1) * rank, offset : offset + b.shape[2]] = b
        offset += b.shape[2]
    return packed
