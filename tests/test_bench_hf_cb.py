"""The transformers continuous-batching peer computes what nanoserve computes: same greedy tokens, its JSON key."""

from __future__ import annotations

import json

import torch

from bench import hf_cb, random_model, throughput
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine

# A chat turn of SmolLM2's template ("What is the capital of France?") and a plain id run.
PROMPTS = [[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198], list(range(100, 140))]
MAX_TOKENS = [12, 7]


def test_greedy_tokens_match_the_inprocess_engine_each_to_its_own_max_tokens():
    args = throughput.parse_args(["--dtype", "float32"])
    torch.set_num_threads(args.threads)
    theirs, seconds = hf_cb.generate(hf_cb.load_model(args), PROMPTS, MAX_TOKENS, temperature=0.0)
    executor = ModelExecutor(ExecutorOptions(dtype="float32", kv_cache_memory=16 << 20, threads=2))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    assert theirs == [c.token_ids for c in Engine(executor).generate(PROMPTS, params)]
    assert seconds > 0


def test_skip_hf_leaves_both_transformers_peers_out(tmp_path):
    """``--skip-hf`` drops ``hf`` and ``hf_cb`` even when named (their keys are written by the W2 smoke test)."""
    folder = random_model.save_random(
        tmp_path / "qwen3", torch.float32, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
        vocab_size=10240,
    )
    path = tmp_path / "w2.json"
    throughput.main(["--workload", "w2", "--model", str(folder), "--num-requests", "1", "--peers", "hf", "hf_cb",
                     "inprocess", "--skip-hf", "--kv-cache-memory", str(64 << 20), "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["inprocess_tok_s"] > 0
    assert not any(key.startswith("hf_") or "_over_hf" in key for key in figures)
