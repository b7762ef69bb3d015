"""The transformers continuous-batching peer of W1 / W2: transformers' own paged-KV engine.

``ContinuousBatchingManager`` (what ``model.generate_batch`` runs) takes every request at once, each with its own
``max_new_tokens`` (``generate_batch`` itself takes one for all), EOS ignored, and schedules them over a paged KV
cache. Attention is transformers' choice for continuous batching on the device (on CUDA, flash attention when
installed); on the CPU it is its paged SDPA.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from bench.common import WARMUP_PROMPT, Workload, progress

# The manager's request-level EOS: none, so every request runs to its max_new_tokens as ignore_eos does.
NO_EOS = -1


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from executor_svc.runtime.registry import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def generate(model: torch.nn.Module, prompts: list[list[int]], max_tokens: list[int], temperature: float,
             on_finished: Callable[[int], object] = lambda num_tokens: None) -> tuple[list[list[int]], float]:
    """Every prompt through one manager session: the generated token ids in prompt order, and the seconds from the
    first request added to the last finished (the manager's start-up, its cache and CUDA graphs, not counted)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
    config = GenerationConfig(**sampling, top_k=None, top_p=None, max_new_tokens=max(max_tokens), eos_token_id=NO_EOS,
                              pad_token_id=model.generation_config.pad_token_id or 0)
    # What generate_batch tells the manager, which sizes its batches from it.
    hints = WorkloadHints(max(map(len, prompts)), max(max_tokens), len(prompts))
    cb_config = ContinuousBatchingConfig()
    if model.device.type == "cpu":  # room for every request at once, not a share of the machine's memory (~8 GB here)
        # transformers 5.17 (the GPU image's) calls a page a block.
        page = getattr(cb_config, "page_size", None) or cb_config.block_size
        pages = (-(-(len(p) + n) // page) for p, n in zip(prompts, max_tokens, strict=True))
        cb_config.num_blocks = sum(pages)
    done: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   workload_hints=hints) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=n, eos_token_id=NO_EOS)
               for prompt, n in zip(prompts, max_tokens, strict=True)]
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before every request finished")
                continue
            if result.is_finished():
                done[result.request_id] = result.generated_tokens
                on_finished(len(result.generated_tokens))
        seconds = time.perf_counter() - start
    return [done[request_id] for request_id in ids], seconds


def run_hf_cb(args: argparse.Namespace, workload: Workload) -> float:
    """Seconds of generation (after model load and a warm-up session) for every request of ``workload``."""
    model = load_model(args)
    generate(model, [WARMUP_PROMPT], [4], 0.0)
    with progress(total=sum(workload.max_tokens), desc="hf continuous batching", unit="tok") as bar:
        outputs, seconds = generate(model, workload.prompts, workload.max_tokens, workload.temperature, bar.update)
    if [len(tokens) for tokens in outputs] != workload.max_tokens:
        raise RuntimeError("transformers' continuous batching ended a request before its max_tokens")
    return seconds
