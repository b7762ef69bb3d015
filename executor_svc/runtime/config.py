"""The model's shape read from a Hugging Face ``config.json``, checked once at load time.

Everything the llama-family implementation needs is normalised here (Llama,
Qwen2 and Qwen3 spell a few things differently), so the model code reads one
dataclass and any configuration it cannot run is refused before a weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Mistral's is Llama's without a sliding window (v0.2 on).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# transformers' defaults for what a config.json may leave out, where they differ by family: (num_key_value_heads,
# head_dim, max_position_embeddings); None: derived from the attention heads.
_FAMILY_DEFAULTS = {"LlamaForCausalLM": (None, None, 2048), "MistralForCausalLM": (None, None, 4096 * 32),
                    "Qwen2ForCausalLM": (32, None, 32768), "Qwen3ForCausalLM": (32, 128, 32768)}
# RoPE frequency scalings computed as transformers computes them (``layers.rotary``); "dynamic", whose frequencies
# change with a sequence's length, and "longrope" are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What each needs besides ``factor``.
_ROPE_KEYS = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("original_max_position_embeddings",)}


class UnsupportedModel(ValueError):
    """A model folder this executor cannot run; the message says why."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's frequency scaling, from ``rope_scaling`` or ``rope_parameters``; unset fields are transformers'
    defaults."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # The dtype the checkpoint was saved in (config.json's dtype or torch_dtype), where it says.
    checkpoint_dtype: str | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise UnsupportedModel(f"{folder} has no config.json; pass a Hugging Face model folder")
        config = json.loads(config_path.read_text())
        generation_path = folder / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dict(config, generation, tokenizer_eos_token_id(folder))

    @classmethod
    def from_dict(cls, config: dict, generation: dict | None = None,
                  tokenizer_eos_id: int | None = None) -> ModelConfig:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else "(none)"
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {architecture} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if config.get("hidden_act", "silu") not in ("silu", "swish"):  # one function under two names
            raise UnsupportedModel(f"activation {config['hidden_act']} is not supported; only silu is")
        if config.get("quantization_config"):
            method = config["quantization_config"].get("quant_method", "unnamed")
            raise UnsupportedModel(f"the checkpoint is quantized ({method}); only unquantized weights are served")
        _refuse_sliding_windows(config, architecture)
        kv_heads, default_head_dim, default_positions = _FAMILY_DEFAULTS[architecture]
        num_heads = config["num_attention_heads"]
        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        rope_theta, rope_scaling = _rope(config)
        # Linear scaling stretches the positions the model was trained on (as vLLM takes it); YaRN's and Llama 3's
        # max_position_embeddings are scaled already.
        stretch = rope_scaling.factor if rope_scaling.rope_type == "linear" else 1
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or kv_heads or num_heads,
            head_dim=config.get("head_dim") or default_head_dim or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=int(config.get("max_position_embeddings", default_positions) * stretch),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 follow attention_bias for all four.
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=_eos_token_ids(config, generation or {}, tokenizer_eos_id),
            bos_token_id=config.get("bos_token_id"),
            rope_scaling=rope_scaling,
            checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
        )

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size that does not divide the sharded dimensions."""
        dims = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        bad = [f"{name}={value}" for name, value in dims.items() if value % tp_size]
        if bad:
            raise UnsupportedModel(f"tensor-parallel size {tp_size} does not divide {', '.join(bad)}")


def _refuse_sliding_windows(config: dict, architecture: str) -> None:
    """Refuse a window any layer would attend through: Mistral's ``sliding_window`` (v0.1's), Qwen2's where
    ``use_sliding_window`` and a layer at or past ``max_window_layers`` (as transformers reads them), or a
    ``layer_types`` entry; a window as long as the model's positions attends to everything and is no window."""
    window = config.get("sliding_window")
    if not window or window >= config.get("max_position_embeddings", _FAMILY_DEFAULTS[architecture][2]):
        return
    if architecture == "MistralForCausalLM":
        raise UnsupportedModel(f"sliding-window attention (sliding_window {window}) is not supported")
    slides = config.get("use_sliding_window") and config.get("max_window_layers", 0) < config["num_hidden_layers"]
    if slides or "sliding_attention" in (config.get("layer_types") or ()):
        raise UnsupportedModel(f"sliding-window attention (sliding_window {window}) is not supported")


def _rope(config: dict) -> tuple[float, RopeScaling]:
    """The base and scaling of RoPE: ``rope_scaling`` where given (as transformers prefers it, model cards add it to
    a transformers-5 config that has ``rope_parameters``), else ``rope_parameters``; the base from either, or the
    older ``rope_theta``."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if any(isinstance(value, dict) for value in scaling.values()):
        raise UnsupportedModel("rope parameters per layer type are not supported")
    base = config.get("rope_parameters") or {}
    theta = float(scaling.get("rope_theta", base.get("rope_theta", config.get("rope_theta", 10000.0))))
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not supported: every head dimension rotates")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    missing = [key for key in ("factor", *_ROPE_KEYS.get(rope_type, ())) if scaling.get(key) is None]
    if missing:
        raise UnsupportedModel(f"rope scaling {rope_type!r} needs {', '.join(missing)} in the config")
    known = {name: scaling[name] for name in RopeScaling.__dataclass_fields__ if scaling.get(name) is not None}
    return theta, RopeScaling(**{**known, "rope_type": rope_type})


def _eos_token_ids(config: dict, generation: dict, tokenizer_eos_id: int | None = None) -> tuple[int, ...]:
    """EOS ids of generation_config.json first, then config.json's, then the tokenizer's own (vLLM always stops on
    it too), without duplicates."""
    ids: list[int] = []
    for source in (generation, config, {"eos_token_id": tokenizer_eos_id}):
        value = source.get("eos_token_id")
        for token_id in [value] if isinstance(value, int) else value or []:
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def tokenizer_config(folder: Path) -> dict | None:
    """tokenizer_config.json, or None where the folder has none."""
    path = Path(folder) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def special_token_text(value: object) -> str | None:
    """A special token of tokenizer_config.json as text: a string, or an AddedToken's ``content``; None if unset."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def tokenizer_eos_token_id(folder: Path) -> int | None:
    """The id tokenizer.json gives tokenizer_config.json's eos_token; None without either, or an unknown token."""
    eos = special_token_text((tokenizer_config(folder) or {}).get("eos_token"))
    path = Path(folder) / "tokenizer.json"
    if eos is None or not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).token_to_id(eos)
    except Exception:  # a tokenizer.json the library cannot read: the scheduler refuses it, naming why
        return None


DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class ExecutorOptions:
    """How to run the model: the executor's command-line flags."""

    model: str = "smollm2-135m-instruct"
    device: str | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    # KV-cache budget in bytes per rank; None: 1 GiB on CPU, the free memory share on CUDA.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None
    max_model_len: int | None = None
    threads: int | None = None
    enforce_eager: bool = False
    # CPU kernels per family and rows: auto (measured at start-up, cached per machine), c, torch, or items.
    cpu_kernels: str = "auto"
    # CPU: a decode step's decoder layers in one C call where they fit (cpu/decode_stack.py).
    cpu_decode_stack: bool = True
    # LoRA adapters loaded at start, name -> PEFT adapter folder (``executor_svc/lora``).
    lora_modules: dict[str, str] = field(default_factory=dict)
    # The highest adapter rank served (factors are padded to it); with runtime_lora, LoRA is on without lora_modules.
    max_lora_rank: int = 16
    # Whether adapters may be loaded and unloaded while serving (LoadLoraAdapter, UnloadLoraAdapter).
    runtime_lora: bool = False
    # Speculative decoding's draft model (``executor_svc/spec/draft.py``): a model of its own (an embedded name or
    # a folder with the same tokenizer), or the served model's first N decoder layers; None: none.
    speculative_model: str | None = None
    speculative_draft_layers: int | None = None

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.runtime_lora

    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, checkpoint_dtype: str | None = None) -> str:
        """Unless given: on CUDA the checkpoint's half precision (float16 stays float16, as vLLM's auto keeps it),
        else bfloat16; on a CPU that names a bfloat16 multiply (AVX512_BF16, AMX) bfloat16, where it runs about twice
        float32's speed (docs/benchmarks.md, W1); float32 on other CPUs, where it does not."""
        dtype = self.dtype or self._default_dtype(checkpoint_dtype)
        if dtype not in DTYPES:
            raise UnsupportedModel(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        return dtype

    def _default_dtype(self, checkpoint_dtype: str | None) -> str:
        if self.resolved_device() != "cpu":
            return "float16" if checkpoint_dtype == "float16" else "bfloat16"
        from executor_svc.cpu.kernels import names_bfloat16_instructions

        return "bfloat16" if names_bfloat16_instructions() else "float32"
