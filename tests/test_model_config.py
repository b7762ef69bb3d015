"""What the loader accepts and refuses, with messages a user can act on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.attention import get_backend
from executor_svc.runtime.config import ModelConfig, UnsupportedModel
from executor_svc.runtime.loader import load_model
from executor_svc.runtime.registry import resolve_model
from tests.model_fixtures import tiny_model_folders  # noqa: F401

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_unsupported_architecture_names_it_and_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModel, match="GemmaForCausalLM.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2"):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GemmaForCausalLM"]})


def test_rope_theta_from_either_spelling() -> None:
    assert ModelConfig.from_dict({**LLAMA, "rope_theta": 5e5}).rope_theta == 5e5
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_dict({**LLAMA, **rope}).rope_theta == 1e6


def test_family_differences() -> None:
    qwen2 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    llama = ModelConfig.from_dict(LLAMA)
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    assert (llama.qkv_bias, llama.qk_norm, llama.head_dim) == (False, False, 8)


def test_eos_ids_merge_generation_config_and_config() -> None:
    config = ModelConfig.from_dict({**LLAMA, "eos_token_id": 7}, {"eos_token_id": [5, 7]})
    assert config.eos_token_ids == (5, 7)


def test_tensor_parallel_size_must_divide_heads() -> None:
    with pytest.raises(UnsupportedModel, match="num_key_value_heads=2"):
        ModelConfig.from_dict(LLAMA).check_tensor_parallel(4)


def test_missing_weight_is_named(tiny_model_folders: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    source = tiny_model_folders["qwen2"]
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    config = ModelConfig.from_folder(tmp_path)
    with pytest.raises(UnsupportedModel, match=r"layers\.1\.self_attn\.qkv_proj\.bias"):
        load_model(tmp_path, config, get_backend("torch", torch.device("cpu")), torch.device("cpu"), torch.float32)


def test_rotary_tables_saved_with_old_checkpoints_are_skipped_and_a_stray_tensor_named(
    tiny_model_folders: dict[str, Path], tmp_path: Path  # noqa: F811
) -> None:
    source = tiny_model_folders["llama"]
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    config, device = ModelConfig.from_folder(tmp_path), torch.device("cpu")
    load_model(tmp_path, config, get_backend("torch", device), device, torch.float32)
    tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModel, match=r"layers\.0\.self_attn\.extra\.weight has no place"):
        load_model(tmp_path, config, get_backend("torch", device), device, torch.float32)


def test_unknown_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="smollm2-135m-instruct"):
        resolve_model(str(tmp_path / "nowhere"))


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="config.json"):
        ModelConfig.from_folder(tmp_path)


def test_tiny_configs_round_trip(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    raw = json.loads((tiny_model_folders["qwen3"] / "config.json").read_text())
    config = ModelConfig.from_folder(tiny_model_folders["qwen3"])
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("Qwen3ForCausalLM", 32, 2)
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
