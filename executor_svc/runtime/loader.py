"""Loads a Hugging Face folder's safetensors (``hf_folder.weight_files``) into the packed, sharded model.

Checkpoint names map one to one onto parameters except the packed ones:
q/k/v projections go into ``qkv_proj`` and gate/up into ``gate_up_proj``, each
at its shard index. A tied LM head is skipped (it is the embedding). Every
parameter must be filled exactly by the checkpoint, otherwise loading fails
naming what is missing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from executor_svc.attention.base import AttentionBackend
from executor_svc.cpu.choice import ALL_C, KernelChoice
from executor_svc.layers.linear import prepack_for_cpu
from executor_svc.models import MODEL_CLASSES
from executor_svc.runtime.config import ModelConfig, UnsupportedModel
from executor_svc.runtime.hf_folder import weight_files

PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Rotary tables some older checkpoints saved with the weights: the model computes its own (vLLM skips them too).
ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def checkpoint_to_param(name: str) -> tuple[str, int]:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, 1)."""
    *path, module, param = name.split(".")
    packed, shard = PACKED.get(module, (module, 0))
    return ".".join([*path, packed, param]), shard


def load_weights(model: nn.Module, folder: str | Path, tie_word_embeddings: bool) -> None:
    files = weight_files(folder)
    params = dict(model.named_parameters(remove_duplicate=False))
    # Every parameter needs each of its packed shards (one for an unpacked parameter).
    missing = {
        name: set(range(len(getattr(model.get_submodule(name.rsplit(".", 1)[0]), "shard_sizes", [0]))))
        for name in params
    }
    if tie_word_embeddings:
        del missing["lm_head.weight"]
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if tie_word_embeddings and name == "lm_head.weight" or name.endswith(ROTARY_BUFFERS):
                    continue
                param_name, shard = checkpoint_to_param(name)
                if param_name not in params:
                    raise UnsupportedModel(f"checkpoint tensor {name} has no place in the model (in {file})")
                module_name, attr = param_name.rsplit(".", 1)
                module = model.get_submodule(module_name)
                tensor = f.get_tensor(name)
                if hasattr(module, "load"):
                    module.load(attr, tensor, shard)
                else:
                    params[param_name].data.copy_(tensor)
                missing[param_name].discard(shard)
    unfilled = sorted(name for name, shards in missing.items() if shards)
    if unfilled:
        raise UnsupportedModel(f"checkpoint in {folder} lacks weights for {', '.join(unfilled[:5])}")


@torch.inference_mode()
def load_model(
    folder: str | Path, config: ModelConfig, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
    kernels: KernelChoice | None = ALL_C,
) -> nn.Module:
    """Build the model for ``config.architecture`` on ``device`` in ``dtype`` and fill it from ``folder``.

    CPU linear weights get the copies ``kernels`` reads (``None``: not chosen yet, so they stay dense for
    ``kernel_probe`` to copy as it measures)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = MODEL_CLASSES[config.architecture](config, backend, dtype)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, folder, config.tie_word_embeddings)
    if kernels is not None:
        prepack_for_cpu(model, c_kernel=kernels.uses("linear", "c"), torch_copy=kernels.uses("linear", "torch"))
    return model.eval()
