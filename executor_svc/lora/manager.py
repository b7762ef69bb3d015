"""The executor's adapters: loaded at start (``--lora-modules``) or at run time, each under a slot of every adapted
projection (``lora.layers``), and the step's rows mapped to those slots before each forward pass.

An adapter's id is what a plan names (``NewRequest.lora_id``); ids are never reused within an instance, so a
scheduler can key its prefix cache on them. Slots are reused: an unloaded adapter's slot takes the next one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from executor_svc.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from executor_svc.lora.adapter import LoraAdapter, LoraError, projection_shape, read_adapter
from executor_svc.lora.layers import LoraBatch, LoraStep, LoraWeights
from executor_svc.runtime.config import ModelConfig
from executor_svc.runtime.distributed import divide, tp_size

# Per adapted projection of a decoder layer: the PEFT module names of its packed shards, in order.
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoadedAdapter:
    """What the handshake lists of an adapter."""

    lora_id: int
    name: str
    path: str
    rank: int


class LoraManager:
    """Adapters by name and id, and the ``LoraWeights`` of every adapted projection of ``model``."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.max_rank, self.dtype, self.device = config, max_rank, dtype, device
        self.step = LoraStep()
        self.projections: dict[tuple[int, str], LoraWeights] = {}
        # Full (out, in) features of each adapted projection: its first shard's, for the input.
        shapes = {name: projection_shape(config, shards[0]) for name, shards in SHARDS.items()}
        for index, layer in enumerate(model.model.layers):
            for name, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
                linear.lora = self.projections[index, name] = _weights_for(
                    linear, shapes[name], self.step, max_rank, dtype, device)
        model.model.lora_step = self.step
        self.adapters: dict[str, LoadedAdapter] = {}
        self._slots: dict[int, int] = {}  # lora id -> slot
        self._next_id = 1
        # Load and unload come from RPC threads while steps run on another.
        self._lock = threading.Lock()

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(self._slots)

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Read, check and install the adapter under a new id; LoraError, changing nothing, if it does not fit or
        ``name`` is taken."""
        if not name or "=" in name:
            raise LoraError(f"an adapter name must be non-empty without '=', got {name!r}")
        if name in self.adapters:
            raise LoraError(f"adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, self.config, self.max_rank)
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
            slot = next(s for s in range(len(self._slots) + 1) if s not in self._slots.values())
            self._install(adapter, slot)
            self._slots[lora_id] = slot
            loaded = self.adapters[name] = LoadedAdapter(lora_id, name, adapter.path, adapter.rank)
        return loaded

    def unload(self, name: str) -> LoadedAdapter:
        """Forget adapter ``name``: the caller has checked that no request uses it."""
        with self._lock:
            loaded = self.adapters.pop(name, None)
            if loaded is None:
                raise LoraError(f"adapter {name!r} is not loaded", "NOT_FOUND")
            slot = self._slots.pop(loaded.lora_id)
            for weights in self.projections.values():
                weights.remove(slot)
        return loaded

    def begin(self, lora_ids: torch.Tensor) -> None:
        """The step about to run has these adapter ids per row (0: the base model)."""
        with self._lock:
            slots = dict(self._slots)
            num_slots = max(slots.values(), default=-1) + 1
        unique, inverse = torch.unique(lora_ids, return_inverse=True)
        per_id = torch.tensor([slots.get(int(i), -1) for i in unique.tolist()], dtype=torch.int64)
        self.step.batch = LoraBatch(per_id[inverse], num_slots, self.device)

    def end(self) -> None:
        self.step.batch = None

    def _install(self, adapter: LoraAdapter, slot: int) -> None:
        for (index, name), weights in self.projections.items():
            weights.install(slot, [adapter.factors.get((index, shard)) for shard in SHARDS[name]], adapter.scaling)


def _weights_for(linear: LinearBase, shape: tuple[int, int], step: LoraStep, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoraWeights:
    """``shape``: the projection's full (out, in) features (its dense weight may be gone, packed for the C kernel)."""
    out_features, in_features = shape
    if isinstance(linear, RowParallelLinear):
        return LoraWeights(step, [(0, out_features)], divide(in_features, tp_size()), max_rank, True, dtype, device)
    assert isinstance(linear, ColumnParallelLinear)
    offsets = [sum(linear.shard_sizes[:i]) for i in range(len(linear.shard_sizes))]
    return LoraWeights(step, list(zip(offsets, linear.shard_sizes, strict=True)), in_features, max_rank, False,
                       dtype, device)
