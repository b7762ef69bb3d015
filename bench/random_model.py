"""W2's model: the Qwen3-0.6B architecture with random weights, saved as a Hugging Face folder.

BENCHMARKS.md allows random weights for throughput, and nothing may be downloaded, so the
folder is built from the published configuration:
``python -m bench.random_model FOLDER`` then ``python -m bench.throughput --workload w2
--device cuda --dtype bfloat16 --model FOLDER``. ``--num-layers`` and friends shrink it for a
quick run on the CPU.
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


def save_random_qwen3(folder: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides: int) -> Path:
    """Qwen3-0.6B (with ``overrides`` applied to its config) with random weights, written to ``folder``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(**{**QWEN3_0_6B, **overrides})
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="where to write config.json and model.safetensors")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"override {name} ({QWEN3_0_6B[name]})")
    args = p.parse_args(argv)
    overrides = {name: value for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
                 if (value := getattr(args, name)) is not None}
    save_random_qwen3(args.folder, getattr(torch, args.dtype), **overrides)
    print(args.folder)


if __name__ == "__main__":
    main()
