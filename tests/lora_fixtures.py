"""LoRA fixtures: random-weight PEFT adapters of the tiny models and SmolLM2, and the transformers + peft reference.

Adapters are made with ``peft`` itself (``init_lora_weights=False``: random A and B, so an adapter changes the
tokens), saved as PEFT saves them (``adapter_config.json`` + ``adapter_model.safetensors``). Nothing downloads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_PROJECTIONS = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base: Path, folder: Path, targets: list[str], rank: int, seed: int, alpha: int = 16,
                        scale: float = 1.0) -> Path:
    """A random LoRA adapter of ``base`` on ``targets``; ``scale`` multiplies B (how far it moves the tokens)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers + peft greedy completions in float32, one prompt at a time, EOS ignored (the reference)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
