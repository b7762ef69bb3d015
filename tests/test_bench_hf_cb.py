"""The transformers continuous-batching peer computes what nanoserve computes: same greedy tokens, its JSON key."""

from __future__ import annotations

import json

import torch

from bench import hf_cb, throughput
from executor_svc.config import ExecutorOptions
from executor_svc.model_executor import ModelExecutor
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams

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


def test_the_peer_writes_its_key_and_skip_hf_leaves_it_out(tmp_path):
    path = tmp_path / "w1.json"
    throughput.main(["--num-requests", "1", "--peers", "hf_cb", "inprocess", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["hf_cb_tok_s"] > 0 and "hf_cb_over_inprocess" in figures
    skipped = tmp_path / "skipped.json"
    throughput.main(["--num-requests", "1", "--peers", "hf_cb", "inprocess", "--skip-hf", "--json", str(skipped)])
    assert "hf_cb_tok_s" not in json.loads(skipped.read_text())
