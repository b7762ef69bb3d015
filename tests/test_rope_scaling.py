"""RoPE scaling as transformers computes it: each scaling's frequencies and attention factor equal transformers', and
a tiny Llama and Qwen3 with Llama 3's and YaRN's scaling give transformers' float32 logits at every position, past
the original context too; what cannot run is refused naming why."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from executor_svc.layers.rotary import inverse_frequencies
from executor_svc.runtime.config import ExecutorOptions, ModelConfig, UnsupportedModel
from executor_svc.runtime.model_runner import ModelRunner
from tests.model_fixtures import TINY_VOCAB, teacher_forced_logits

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
}
TINY = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def hf_config(family: str, scaling: dict, theta: float = 10000.0) -> LlamaConfig | Qwen3Config:
    rope = {**scaling, "rope_theta": theta}
    if family == "qwen3":
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True, rope_parameters=rope)
    return LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=rope)


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    config = hf_config("llama", SCALINGS[name], theta=500000.0)
    expected, attention = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config)
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    freqs, factor = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(freqs, expected, rtol=0, atol=0)
    assert factor == pytest.approx(attention)


def test_rope_scaling_is_read_before_rope_parameters_as_transformers_reads_it() -> None:
    """A transformers-5 config (rope_parameters, plain) that a model card's rope_scaling block was added to."""
    base = {**hf_config("llama", {"rope_type": "default"}, theta=1e6).to_dict(), "architectures": ["LlamaForCausalLM"]}
    config = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 128}})
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor, config.rope_theta) == ("yarn", 4.0, 1e6)
    linear = ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.max_position_embeddings == 1024  # linear scaling stretches the positions, as vLLM takes it


@pytest.mark.parametrize(("rope", "reason"), [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor, high_freq_factor, original"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max_position_embeddings"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_what_cannot_run_is_refused_naming_it(rope: dict, reason: str) -> None:
    config = {**hf_config("llama", {"rope_type": "default"}).to_dict(), "architectures": ["LlamaForCausalLM"]}
    config.pop("rope_parameters")
    with pytest.raises(UnsupportedModel, match=reason):
        ModelConfig.from_dict({**config, **rope})


@pytest.mark.parametrize("kernels", ["torch", "c"])
@pytest.mark.parametrize(("family", "name"), [("llama", "llama3"), ("llama", "yarn"), ("qwen3", "yarn-mscale"),
                                              ("qwen3", "linear")])
def test_a_scaled_model_gives_transformers_logits_past_the_original_context(family: str, name: str, kernels: str,
                                                                           tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family, SCALINGS[name]), dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    rng = random.Random(1)
    sequence = [rng.randrange(3, TINY_VOCAB) for _ in range(200)]  # positions to 199, past 64 and its multiples
    with torch.inference_mode():
        expected = model(torch.tensor([sequence])).logits[0, :-1]
    options = ExecutorOptions(model=str(tmp_path), dtype="float32", block_size=8, kv_cache_memory=4 << 20, threads=1,
                              cpu_kernels=kernels)
    [logits] = teacher_forced_logits(ModelRunner(tmp_path, options), [sequence], [120])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
