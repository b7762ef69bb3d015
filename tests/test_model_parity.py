"""Greedy tokens match Hugging Face transformers (float32, same weights) token for token.

Each model runs its prompts three ways through the scheduler Engine and the
ModelExecutor: all at once as one continuous batch, again on the same engine
(prefix-cache hits), and on a fresh engine whose token budget forces chunked
prefill with chunk boundaries inside KV blocks. The reference is HF ``generate``
one prompt at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from executor_svc.config import ExecutorOptions
from executor_svc.model_executor import ModelExecutor
from scheduler_svc.engine import Engine
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import SchedulerConfig
from tests.model_fixtures import TINY_VOCAB, hf_greedy, smollm2_folder, tiny_model_folders  # noqa: F401

MAX_NEW_TOKENS = 64

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colors:",
    "The mitochondria is the powerhouse of the cell. In this essay we will explore how cells produce energy, "
    "why oxygen matters for respiration, and what happens when mitochondria fail. First,",
    "Translate to French: 'The weather is nice today and I would like to go for a walk in the park with my dog, "
    "who loves chasing squirrels, ducks and the occasional bicycle.' Answer:",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves falling into a quiet river at dusk.",
]


@dataclass
class ParityRun:
    reference: list[list[int]]
    batched: list[list[int]]
    repeated: list[list[int]]
    prefix_hit_tokens: int
    chunked: list[list[int]]
    chunk_budget: int
    longest_prompt: int


def run_parity(
    folder: Path, prompts: list[list[int]], *, stop_at_eos: bool, block_size: int, chunk_budget: int, kv_bytes: int
) -> ParityRun:
    reference = hf_greedy(folder, prompts, MAX_NEW_TOKENS, stop_at_eos)
    executor = ModelExecutor(
        ExecutorOptions(model=str(folder), block_size=block_size, kv_cache_memory=kv_bytes, threads=2)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=not stop_at_eos)
    engine = Engine(executor)
    batched = [c.token_ids for c in engine.generate(prompts, params)]
    repeated = [c.token_ids for c in engine.generate(prompts[::-1], params)][::-1]
    prefix_hit_tokens = engine.scheduler.num_prefix_hit_tokens
    chunked_engine = Engine(executor, SchedulerConfig(max_num_batched_tokens=chunk_budget))
    chunked = [c.token_ids for c in chunked_engine.generate(prompts, params)]
    return ParityRun(
        reference, batched, repeated, prefix_hit_tokens, chunked, chunk_budget, max(len(p) for p in prompts)
    )


def smollm2_prompts(folder: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in CHAT_PROMPTS
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXT_PROMPTS + chats]


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 130, 7)]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "llama", "qwen2", "qwen3"])
def parity(request: pytest.FixtureRequest) -> ParityRun:
    if request.param == "smollm2-135m-instruct":
        folder = request.getfixturevalue("smollm2_folder")
        return run_parity(
            folder, smollm2_prompts(folder), stop_at_eos=True, block_size=16, chunk_budget=40, kv_bytes=256 << 20
        )
    folder = request.getfixturevalue("tiny_model_folders")[request.param]
    return run_parity(
        folder, random_prompts(len(request.param)), stop_at_eos=False, block_size=8, chunk_budget=24,
        kv_bytes=16 << 20,
    )


def test_continuous_batch_matches_hf(parity: ParityRun) -> None:
    assert parity.batched == parity.reference


def test_prefix_cache_hits_match_hf(parity: ParityRun) -> None:
    assert parity.prefix_hit_tokens > 0
    assert parity.repeated == parity.reference


def test_chunked_prefill_matches_hf(parity: ParityRun) -> None:
    assert parity.longest_prompt > parity.chunk_budget
    assert parity.chunked == parity.reference
