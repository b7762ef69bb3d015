"""Greedy tokens match Hugging Face transformers (float32, same weights) token for token.

Each model runs its prompts twice through the scheduler Engine and the
ModelExecutor: all at once as one continuous batch; then on an engine whose
token budget forces chunked prefill (chunk boundaries inside KV blocks), with
two prompts repeated at the end so they hit the prefix cache their first
copies filled. The reference is HF ``generate``, one prompt at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import TINY_VOCAB, hf_greedy, smollm2_folder, tiny_model_folders  # noqa: F401

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


# Prompts run a second time at the end of the chunked pass, to hit the prefix cache.
REPEATED = (3, 4)


@dataclass
class ParityRun:
    reference: list[list[int]]
    batched: list[list[int]]
    chunked: list[list[int]]
    multi_step: list[list[int]]
    prefix_hit_tokens: int
    chunk_budget: int
    longest_prompt: int


def run_parity(
    folder: Path,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_at_eos: bool,
    block_size: int,
    chunk_budget: int,
    kv_bytes: int,
) -> ParityRun:
    reference = hf_greedy(folder, prompts, max_new_tokens, stop_at_eos)
    executor = ModelExecutor(
        ExecutorOptions(model=str(folder), block_size=block_size, kv_cache_memory=kv_bytes, threads=2)
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=not stop_at_eos)
    batched = [c.token_ids for c in Engine(executor).generate(prompts, params)]
    chunked_engine = Engine(executor, SchedulerConfig(max_num_batched_tokens=chunk_budget))
    with_repeats = prompts + [prompts[i] for i in REPEATED]
    chunked = [c.token_ids for c in chunked_engine.generate(with_repeats, params)]
    multi_step_engine = Engine(executor, SchedulerConfig(num_scheduler_steps=8))
    multi_step = [c.token_ids for c in multi_step_engine.generate(prompts, params)]
    assert multi_step_engine.block_manager.num_free_blocks == multi_step_engine.block_manager.num_blocks
    return ParityRun(
        reference,
        batched,
        chunked,
        multi_step,
        chunked_engine.scheduler.num_prefix_hit_tokens,
        chunk_budget,
        max(len(p) for p in prompts),
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


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("smollm2-135m-instruct", 64), id="smollm2"),
        pytest.param(("llama", 64), id="llama"),
        pytest.param(("qwen2", 64), id="qwen2"),
        pytest.param(("qwen3", 64), id="qwen3"),
    ],
)
def parity(request: pytest.FixtureRequest) -> ParityRun:
    family, max_new_tokens = request.param
    if family == "smollm2-135m-instruct":
        folder = request.getfixturevalue("smollm2_folder")
        return run_parity(
            folder, smollm2_prompts(folder), max_new_tokens=max_new_tokens, stop_at_eos=True, block_size=16,
            chunk_budget=40, kv_bytes=256 << 20,
        )
    folder = request.getfixturevalue("tiny_model_folders")[family]
    return run_parity(
        folder, random_prompts(len(family)), max_new_tokens=max_new_tokens, stop_at_eos=False, block_size=8,
        chunk_budget=24, kv_bytes=16 << 20,
    )


def test_continuous_batch_matches_hf(parity: ParityRun) -> None:
    assert parity.batched == parity.reference


def test_multi_step_decode_matches_hf(parity: ParityRun) -> None:
    assert parity.multi_step == parity.reference


def test_chunked_prefill_matches_hf(parity: ParityRun) -> None:
    assert parity.longest_prompt > parity.chunk_budget
    assert parity.chunked[: len(parity.reference)] == parity.reference


def test_prefix_cache_hits_match_hf(parity: ParityRun) -> None:
    assert parity.prefix_hit_tokens > 0
    assert parity.chunked[len(parity.reference) :] == [parity.reference[i] for i in REPEATED]
