"""W2's model: the Qwen3-0.6B architecture with random weights, saved as a Hugging Face folder.

BENCHMARKS.md allows random weights for throughput, and nothing may be downloaded, so the
folder is built from the published configuration:
``python -m bench.random_model FOLDER`` then ``python -m bench.throughput --workload w2
--device cuda --dtype bfloat16 --model FOLDER``. ``--num-hidden-layers`` and friends shrink it for a
quick run on the CPU. ``--arch smollm2-135m`` builds W1's model the same way, for a machine that lacks
the embedded model's wheel (the GPU machine, whose host CPU is worth measuring too).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

# Qwen/Qwen3-0.6B's config.json, the fields the architecture depends on.
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


# HuggingFaceTB/SmolLM2-135M-Instruct's config.json (W1's embedded model), the fields the architecture depends on.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

ARCHES = {"qwen3-0.6b": ("Qwen3Config", QWEN3_0_6B), "smollm2-135m": ("LlamaConfig", SMOLLM2_135M)}


def save_random(folder: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, *, arch: str = "qwen3-0.6b",
                **overrides: int) -> Path:
    """``arch`` (with ``overrides`` applied to its config) with random weights, written to ``folder``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config_class, fields = ARCHES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="where to write config.json and model.safetensors")
    p.add_argument("--arch", default="qwen3-0.6b", choices=list(ARCHES), help="published architecture to build")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"override the architecture's {name}")
    args = p.parse_args(argv)
    overrides = {name: value for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
                 if (value := getattr(args, name)) is not None}
    save_random(args.folder, getattr(torch, args.dtype), arch=args.arch, **overrides)
    print(args.folder)


if __name__ == "__main__":
    main()
