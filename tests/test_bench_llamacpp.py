"""The llama.cpp peer runs the weights nanoserve runs: same greedy tokens, slots reused cleanly, its JSON key."""

from __future__ import annotations

import json
import sys

import pytest

from bench import llamacpp, throughput
from bench.gguf_convert import converted_gguf
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine

# A chat turn of SmolLM2's template ("What is the capital of France?") and two plain id runs.
PROMPTS = [
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    list(range(100, 140)),
    list(range(500, 520)),
]
NEW_TOKENS = 16


def test_without_llama_cpp_the_default_run_leaves_it_out_and_asking_for_it_names_the_recipe(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    default = throughput.parse_args([])
    assert llamacpp.admit(default, list(throughput.PEERS)) == [
        "hf", "hf_cb", "inprocess", "inprocess_layers", "inprocess_overlap", "split", "split_overlap", "split_tokens",
        "split_whole", "split_yield", "vllm"]
    assert "GGML_NATIVE=ON" in capsys.readouterr().err
    asked = throughput.parse_args(["--peers", "inprocess", "llamacpp"])
    with pytest.raises(SystemExit, match="GGML_NATIVE=ON"):
        llamacpp.admit(asked, asked.peers)
    with pytest.raises(SystemExit, match="GGML_NATIVE=ON"):
        llamacpp.import_llama_cpp()


def test_greedy_tokens_match_the_inprocess_engine_on_the_float32_gguf():
    pytest.importorskip("llama_cpp")
    # Two slots for three requests: the third reuses a slot whose KV sequence was cleared.
    with llamacpp.ContinuousBatcher(converted_gguf(DEFAULT_MODEL, "float32"), "float32", 2, 2, 256) as batcher:
        ours = batcher.generate(PROMPTS, [NEW_TOKENS] * len(PROMPTS))
    executor = ModelExecutor(ExecutorOptions(dtype="float32", kv_cache_memory=16 << 20, threads=2))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert ours == [c.token_ids for c in Engine(executor).generate(PROMPTS, params)]


def test_the_peer_writes_its_key(tmp_path):
    pytest.importorskip("llama_cpp")
    path = tmp_path / "w1.json"
    throughput.main(["--num-requests", "1", "--peers", "llamacpp", "--json", str(path)])
    assert json.loads(path.read_text())["llamacpp_tok_s"] > 0
