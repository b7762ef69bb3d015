"""Checkpoints as transformers reads them: what changes the computation is honoured (float32 logits equal
transformers') or refused naming why, never computed some other way."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from executor_svc.runtime.config import ExecutorOptions, ModelConfig, UnsupportedModel
from executor_svc.runtime.model_runner import ModelRunner
from tests.model_fixtures import TINY_VOCAB, teacher_forced_logits

TINY = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def runner(folder: Path, **options: object) -> ModelRunner:
    given = dict(model=str(folder), dtype="float32", block_size=8, kv_cache_memory=4 << 20, threads=1,
                 cpu_kernels="torch")
    return ModelRunner(folder, ExecutorOptions(**(given | options)))


def assert_transformers_logits(folder: Path) -> None:
    """One sequence's logits at every position, fed its own tokens, equal transformers' on the same folder."""
    sequence = [random.Random(1).randrange(3, TINY_VOCAB) for _ in range(40)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([sequence])).logits[0, :-1]
    [logits] = teacher_forced_logits(runner(folder), [sequence], [24])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def saved(config: object, folder: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_mistral_without_a_window_is_llama(tmp_path: Path) -> None:
    assert_transformers_logits(saved(MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False), tmp_path))


def test_a_window_no_layer_attends_through_and_swish_run_as_transformers_runs_them(tmp_path: Path) -> None:
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=2, hidden_act="swish")
    assert_transformers_logits(saved(config, tmp_path))


def test_a_tied_config_over_a_different_lm_head_serves_that_head_as_transformers_does(tmp_path: Path) -> None:
    folder = saved(LlamaConfig(**TINY, tie_word_embeddings=False), tmp_path)
    edit_config(folder, tie_word_embeddings=True)
    assert not runner(folder).config.tie_word_embeddings
    assert_transformers_logits(folder)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantized \(fp8\)"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, "sliding_window 16"),
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "sliding_window 16"),
])
def test_what_would_compute_otherwise_is_refused(changes: dict, reason: str) -> None:
    config = {**Qwen2Config(**TINY).to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(UnsupportedModel, match=reason):
        ModelConfig.from_dict({**config, **changes})


def test_a_tensor_of_another_shape_than_the_config_gives_it_is_refused(tmp_path: Path) -> None:
    folder = saved(LlamaConfig(**TINY, tie_word_embeddings=True), tmp_path)
    edit_config(folder, vocab_size=TINY_VOCAB - 64)  # transformers refuses a size mismatch, where narrowing hid it
    with pytest.raises(UnsupportedModel, match=r"model.embed_tokens.weight is \(512, 64\); config.json makes it"):
        runner(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:32]
    save_file(tensors, folder / "model.safetensors")
    edit_config(folder, vocab_size=TINY_VOCAB)
    with pytest.raises(UnsupportedModel, match="q_proj.weight is"):
        runner(folder)


def test_defaults_a_config_leaves_out_are_transformers_ones() -> None:
    bare = {key: value for key, value in TINY.items() if key not in ("num_key_value_heads", "max_position_embeddings")}
    qwen3 = ModelConfig.from_dict({**bare, "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2})
    llama = ModelConfig.from_dict({**bare, "architectures": ["LlamaForCausalLM"]})
    assert (qwen3.head_dim, qwen3.max_position_embeddings) == (128, 32768)
    assert (llama.head_dim, llama.num_kv_heads, llama.max_position_embeddings) == (16, 4, 2048)


def test_on_cuda_a_float16_checkpoint_runs_in_float16_unless_told() -> None:
    options = ExecutorOptions(model="m", device="cuda")
    assert [options.resolved_dtype(d) for d in ("float16", "bfloat16", "float32", None)] == [
        "float16", "bfloat16", "bfloat16", "bfloat16"]
    assert ExecutorOptions(model="m", device="cuda", dtype="float32").resolved_dtype("float16") == "float32"
    assert ExecutorOptions(model="m", device="cpu", dtype="float32").resolved_dtype("float16") == "float32"
