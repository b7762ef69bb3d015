"""Reads a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) and checks that it fits
the base model before any of it is used.

Each targeted projection ``W`` [out, in] of a decoder layer gets ``W x + scaling * B (A x)``, A [r, in], B [out, r],
``scaling`` = ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), as PEFT computes it. Anything PEFT can save that this
executor does not run (DoRA, LoRA biases, embedding or LM-head adapters, per-module rank or alpha patterns) is
refused with a message that names it, so that a misfit adapter never serves silently wrong tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from common.executor import LoraRefused
from executor_svc.runtime.config import ModelConfig

# The projections an adapter may target, by PEFT's module names, and where each sits in a decoder layer.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json entries whose non-default values change the computation in ways not implemented here.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "layer_replication": None, "lora_bias": False,
                "trainable_token_indices": None, "alora_invocation_tokens": None, "use_qalora": False}


class LoraError(LoraRefused):
    """An adapter this executor cannot serve, or a load or unload it refuses; the message says why."""


@dataclass
class LoraAdapter:
    """One adapter's low-rank factors, full size (unsharded), by (layer index, projection name)."""

    name: str
    path: str
    rank: int
    scaling: float
    # (layer, projection) -> (A [r, in], B [out, r])
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({projection for _, projection in self.factors})


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, int]:
    """(out, in) features of a projection in the base model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[projection]


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter in ``path``, checked against the base model's ``config`` and ``max_rank``; LoraError if not."""
    folder = Path(path)
    settings = _read_config(folder)
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter {name!r}: adapter_config.json needs a positive integer r, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoraError(f"adapter {name!r}: adapter_config.json needs a number lora_alpha, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    tensors = _read_tensors(name, folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or PROJECTIONS.get(match[3]) != match[2]:
            raise LoraError(f"adapter {name!r}: tensor {key} is not a LoRA factor of a q, k, v, o, gate, up or "
                            "down projection, the only ones this executor adapts")
        layer = int(match[1])
        if layer >= config.num_layers:
            raise LoraError(f"adapter {name!r}: tensor {key} names layer {layer}; the model has {config.num_layers}")
        pairs.setdefault((layer, match[3]), {})[match[4]] = tensor
    if not pairs:
        raise LoraError(f"adapter {name!r}: {folder} holds no LoRA factors")
    factors = {}
    for (layer, projection), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {projection} lacks its lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        out_features, in_features = projection_shape(config, projection)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoraError(
                f"adapter {name!r}: layer {layer} {projection} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"rank {rank} on this model needs A {(rank, in_features)} and B {(out_features, rank)}")
        factors[layer, projection] = (a, b)
    return LoraAdapter(name, str(folder), rank, scaling, factors)


def _read_config(folder: Path) -> dict:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise LoraError(f"{folder} has no adapter_config.json; pass a PEFT LoRA adapter folder")
    try:
        settings = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"{config_path} is not JSON: {e}") from None
    if not isinstance(settings, dict):
        raise LoraError(f"{config_path} holds a {type(settings).__name__}, not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{folder} is a {settings['peft_type']} adapter; only LORA adapters are served")
    for key, default in _UNSUPPORTED.items():
        if settings.get(key) not in (default, None, {}, [], False):
            raise LoraError(f"{folder}: adapter_config.json sets {key}={settings[key]!r}, which is not supported")
    if settings.get("bias", "none") != "none":
        raise LoraError(f"{folder}: adapter_config.json sets bias={settings['bias']!r}; only 'none' is supported")
    return settings


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoraError(f"adapter {name!r}: {folder} has no adapter_model.safetensors (only safetensors are read)")
    try:
        return load_file(weights)
    except (SafetensorError, OSError) as e:
        raise LoraError(f"adapter {name!r}: {weights} is not a readable safetensors file: {e}") from None
