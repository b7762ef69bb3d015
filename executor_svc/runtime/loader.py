"""Loads a Hugging Face folder's safetensors (``hf_folder.weight_files``) into the packed, sharded model.

Checkpoint names map one to one onto parameters except the packed ones:
q/k/v projections go into ``qkv_proj`` and gate/up into ``gate_up_proj``, each
at its shard index. A tied LM head is skipped (it is the embedding). Every
parameter must be filled exactly by the checkpoint, each tensor of the shape the
config gives it, otherwise loading fails naming what is missing or misshapen.
"""

from __future__ import annotations

import dataclasses
import logging
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

log = logging.getLogger("nanoserve.executor")


def checkpoint_shape(name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The full (unsharded) shape ``config`` gives checkpoint tensor ``name``; None for one it does not know."""
    *_, module, param = name.split(".")
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    out_in = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "embed_tokens": (config.vocab_size, h),
              "lm_head": (config.vocab_size, h)}
    if module in out_in:
        return out_in[module] if param == "weight" else out_in[module][:1]
    if module in ("q_norm", "k_norm"):
        return (d,)
    return (h,) if module.endswith("norm") else None


def untie_a_different_head(folder: str | Path, config: ModelConfig) -> ModelConfig:
    """A config that ties the LM head to the embedding over a checkpoint whose own ``lm_head.weight`` differs: that
    head is used, untied, as transformers loads it (a warning says so)."""
    if not config.tie_word_embeddings:
        return config
    names = ("lm_head.weight", "model.embed_tokens.weight")
    where = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            where.update({name: file for name in f.keys() if name in names})  # noqa: SIM118 - not a mapping
    if len(where) < 2:  # no head of its own (the usual tied checkpoint): nothing read
        return config
    head, embedding = (_tensor(where[name], name) for name in names)
    if torch.equal(head, embedding):
        return config
    log.warning("config.json ties the LM head to the embedding, but the checkpoint's lm_head.weight differs: "
                "serving that head, untied, as transformers does")
    return dataclasses.replace(config, tie_word_embeddings=False)


def checkpoint_to_param(name: str) -> tuple[str, int]:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, 1)."""
    *path, module, param = name.split(".")
    packed, shard = PACKED.get(module, (module, 0))
    return ".".join([*path, packed, param]), shard


def _tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def load_weights(model: nn.Module, folder: str | Path, config: ModelConfig) -> None:
    tie_word_embeddings = config.tie_word_embeddings
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
                if (shape := checkpoint_shape(name, config)) is not None and tuple(tensor.shape) != shape:
                    raise UnsupportedModel(f"checkpoint tensor {name} is {tuple(tensor.shape)}; config.json makes "
                                           f"it {shape} (in {file})")
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
    load_weights(model, folder, config)
    if kernels is not None:
        prepack_for_cpu(model, c_kernel=kernels.uses("linear", "c"), torch_copy=kernels.uses("linear", "torch"))
    return model.eval()
