"""Greedy tokens match Hugging Face transformers (float32, same weights) token for token.

Each model runs its prompts twice through the scheduler Engine and the
ModelExecutor: all at once as one continuous batch; then on an engine whose
token budget forces chunked prefill (chunk boundaries inside KV blocks), with
two prompts repeated at the end so they hit the prefix cache their first
copies filled; and the same under the mixed scheduling policy, where decodes and prefill chunks share steps.
The reference is HF ``generate``, one prompt at a time.

The tiny models run under each CPU kernel choice (``c``, ``torch``, and ``auto``, what this machine measured), so
that the choice of the machine running the suite cannot hide a kernel that breaks parity; SmolLM2 runs under the
session's (``NANOSERVE_CPU_KERNELS``, else ``auto``: ``make test-kernels`` forces each).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from executor_svc.attention import cpu_backend
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.model_input import ModelInput
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import (  # noqa: F401
    TINY_VOCAB,
    hf_greedy,
    in_spinning_process,
    smollm2_folder,
    tiny_model_folders,
)

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
    # Under the mixed policy, and how many of its steps held decodes beside prefill chunks.
    mixed: list[list[int]]
    mixed_steps: int
    # The executor's steps that ran decode rows through decode attention beside prefill chunks, and those of them
    # that packed a decode row ahead of a chunk the plan put before it.
    split_steps: int
    reordered_steps: int
    prefix_hit_tokens: int
    chunk_budget: int
    longest_prompt: int


def run_parity(
    folder: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    *,
    max_new_tokens: int,
    stop_at_eos: bool,
    block_size: int,
    chunk_budget: int,
    kv_bytes: int,
    cpu_kernels: str | None = None,
) -> ParityRun:
    kernels = {} if cpu_kernels is None else {"cpu_kernels": cpu_kernels}
    executor = ModelExecutor(
        ExecutorOptions(dtype="float32", model=str(folder), block_size=block_size, kv_cache_memory=kv_bytes, threads=2,
                        **kernels)
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=not stop_at_eos)
    batched = [c.token_ids for c in Engine(executor).generate(prompts, params)]
    chunked_engine = Engine(executor, SchedulerConfig(max_num_batched_tokens=chunk_budget))
    with_repeats = prompts + [prompts[i] for i in REPEATED]
    chunked = [c.token_ids for c in chunked_engine.generate(with_repeats, params)]
    mixed_engine = Engine(executor, SchedulerConfig(max_num_batched_tokens=chunk_budget, num_scheduler_steps=8,
                                                    policy="mixed"))
    mixed_steps = count_mixed_steps(mixed_engine)
    split_steps = count_split_steps(executor)
    with pytest.MonkeyPatch.context() as patch:  # the CPU backend splits steps of these few decode rows too
        patch.setattr(cpu_backend, "MIN_SPLIT_DECODES", 1)
        mixed = [c.token_ids for c in mixed_engine.generate(with_repeats, params)]
    del executor.runner.execute  # the class's again
    multi_step_engine = Engine(executor, SchedulerConfig(num_scheduler_steps=8))
    multi_step = [c.token_ids for c in multi_step_engine.generate(prompts, params)]
    assert_all_blocks_free(multi_step_engine.block_manager)
    return ParityRun(
        reference,
        batched,
        chunked,
        multi_step,
        mixed,
        mixed_steps[0],
        *split_steps,
        chunked_engine.scheduler.num_prefix_hit_tokens,
        chunk_budget,
        max(len(p) for p in prompts),
    )


def count_mixed_steps(engine: Engine) -> list[int]:
    """A counter of the steps the engine's scheduler fills with decodes and prefill chunks together."""
    count = [0]
    schedule = engine.scheduler.schedule

    def counted(*args: bool) -> tuple[list, bool]:
        seqs, is_prefill = schedule(*args)
        decoding = [s for s in seqs if s.num_cached_tokens >= s.num_prompt_tokens and s.num_scheduled_tokens == 1]
        count[0] += is_prefill and 0 < len(decoding) < len(seqs)
        return seqs, is_prefill

    engine.scheduler.schedule = counted
    return count


def count_split_steps(executor: ModelExecutor) -> list[int]:
    """Counters of the executor's split steps and of those whose rows it reordered (``ParityRun``)."""
    counts = [0, 0]
    execute = executor.runner.execute

    def counted(model_input: ModelInput, *behind: object) -> torch.Tensor:
        if model_input.meta.mixed is not None:
            counts[0] += 1
            counts[1] += bool((model_input.logits_indices.diff() < 0).any())
        return execute(model_input, *behind)

    executor.runner.execute = counted
    return counts


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


KERNEL_SETS = ("c", "torch", "auto")
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_references() -> dict[str, list[list[int]]]:
    """Each model's reference tokens, made once for all the kernel choices it runs under."""
    return {}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("smollm2-135m-instruct", None), id="smollm2"),
        *(pytest.param((family, kernels), id=f"{family}-{kernels}")
          for family in ("llama", "qwen2", "qwen3") for kernels in KERNEL_SETS),
    ],
)
def parity(request: pytest.FixtureRequest, hf_references: dict[str, list[list[int]]]) -> ParityRun:
    family, cpu_kernels = request.param
    if family == "smollm2-135m-instruct":
        folder = request.getfixturevalue("smollm2_folder")
        return in_spinning_process(smollm2_parity, folder, smollm2_prompts(folder))
    folder = request.getfixturevalue("tiny_model_folders")[family]
    prompts = random_prompts(len(family))
    if family not in hf_references:
        hf_references[family] = hf_greedy(folder, prompts, MAX_NEW_TOKENS, stop_at_eos=False)
    return run_parity(folder, prompts, hf_references[family], max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=False,
                      cpu_kernels=cpu_kernels, block_size=8, chunk_budget=24, kv_bytes=16 << 20)


def smollm2_parity(folder: Path, prompts: list[list[int]]) -> ParityRun:
    """SmolLM2's reference and run, for ``in_spinning_process``: hundreds of float32 steps of a real model, each of
    many small ops."""
    reference = hf_greedy(folder, prompts, MAX_NEW_TOKENS, stop_at_eos=True)
    return run_parity(folder, prompts, reference, max_new_tokens=MAX_NEW_TOKENS, stop_at_eos=True, block_size=16,
                      chunk_budget=40, kv_bytes=256 << 20)


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


def test_mixed_steps_match_hf(parity: ParityRun) -> None:
    """Greedy float32 tokens are the same whichever policy runs: decodes beside prefill chunks change none."""
    assert parity.mixed_steps > 0 and parity.split_steps > 0 and parity.reordered_steps > 0
    assert parity.mixed == parity.reference + [parity.reference[i] for i in REPEATED]
