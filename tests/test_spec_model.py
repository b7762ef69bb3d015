"""Verification on real models: with any proposals, the tokens are exactly those of plain decoding (greedy in
float32, and seeded sampling), inside mixed batches, with logits processors and grammars."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401
from tests.spec_helpers import GREEDY, SpecDriver

KV_BYTES = 4 << 20


def executor_for(folder: Path, **options: object) -> ModelExecutor:
    return ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), block_size=4, kv_cache_memory=KV_BYTES,
                                         threads=1, **options))


@pytest.fixture(scope="module")
def qwen3(tiny_model_folders: dict[str, Path]) -> ModelExecutor:  # noqa: F811
    return executor_for(tiny_model_folders["qwen3"])


def prompts(vocab: int, n: int, seed: int = 0) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {rid: rng.integers(3, vocab, int(rng.integers(5, 12))).tolist() for rid in range(1, n + 1)}


def plain(executor: ModelExecutor, requests: dict[int, list[int]], max_tokens: int,
          sampling: SamplingSettings = GREEDY) -> dict[int, list[int]]:
    driver = SpecDriver(executor)
    out = driver.generate(requests, max_tokens, lambda rid, tokens: [], sampling)
    driver.finish()
    return out


def speculated(executor: ModelExecutor, requests: dict[int, list[int]], max_tokens: int,
               reference: dict[int, list[int]], right: float, sampling: SamplingSettings = GREEDY,
               seed: int = 1) -> tuple[dict[int, list[int]], list[int]]:
    """Generate with proposals of up to 4 tokens, each the reference's with probability ``right``; the outputs and
    every verification row's count."""
    rng = np.random.default_rng(seed)
    vocab = executor.get_info().vocab_size

    def propose(rid: int, tokens: list[int]) -> list[int]:
        done = len(tokens) - len(requests[rid])
        ahead = reference[rid][done : done + int(rng.integers(1, 5))]
        return [t if rng.random() < right else (t + 1) % vocab for t in ahead]

    driver = SpecDriver(executor)
    out = driver.generate(requests, max_tokens, propose, sampling)
    counts = [n for result in driver.results for n in result.num_sampled_tokens]
    driver.finish()
    assert len(executor.table) == 0
    return out, counts


@pytest.mark.parametrize("right", [0.0, 0.6, 1.0])
def test_greedy_with_proposals_gives_the_tokens_of_plain_decoding(qwen3: ModelExecutor, right: float) -> None:
    requests = prompts(qwen3.get_info().vocab_size, 3)
    reference = plain(qwen3, requests, 16)
    out, counts = speculated(qwen3, requests, 16, reference, right)
    assert out == reference
    if right == 0.0:
        assert set(counts) == {1}
    if right == 1.0:
        assert max(counts) == 5  # all four accepted, and the token after them


def test_seeded_sampling_with_proposals_gives_the_tokens_of_plain_decoding(qwen3: ModelExecutor) -> None:
    sampling = SamplingSettings(temperature=1.0, top_k=50, seed=1234, repetition_penalty=1.2, frequency_penalty=0.5,
                                min_tokens=20, logit_bias=((7, 3.0),), num_logprobs=2)
    requests = prompts(qwen3.get_info().vocab_size, 2, seed=3)
    driver = SpecDriver(qwen3)
    reference = driver.generate(requests, 14, lambda rid, tokens: [], sampling)
    plain_logprobs = [lp for result in driver.results for lp in result.logprobs]
    driver.finish()
    out, counts = speculated(qwen3, requests, 14, reference, 0.7, sampling)
    assert out == reference
    assert max(counts) > 2, "some proposals should have been accepted"
    assert plain_logprobs and all(lp is not None and len(lp.top_token_ids) == 2 for lp in plain_logprobs)


def test_a_verification_inside_a_mixed_batch(qwen3: ModelExecutor) -> None:
    """One step: a new prompt's prefill chunk, a plain decode row and a verification row crossing a block boundary."""
    vocab = qwen3.get_info().vocab_size
    requests = prompts(vocab, 3, seed=5)
    reference = plain(qwen3, requests, 8)
    driver = SpecDriver(qwen3)
    driver.prefill({1: requests[1], 2: requests[2]})
    # Request 1 verifies 5 proposals (the 4th wrong); request 2 decodes one token; request 3 arrives.
    tracked = driver.requests
    proposals = [*reference[1][1:4], (reference[1][4] + 1) % vocab, 9]
    cached = CachedRequests()
    for rid, k in ((1, len(proposals)), (2, 0)):
        new = driver._grow(tracked[rid], tracked[rid].num_computed + 1 + k)
        cached.request_ids.append(rid)
        cached.num_computed_tokens.append(tracked[rid].num_computed)
        cached.num_scheduled_tokens.append(1 + k)
        cached.num_new_blocks.append(len(new))
        cached.new_block_ids += new
        cached.num_draft_tokens.append(k)
    cached.draft_token_ids = proposals
    table = driver.free[:4]
    del driver.free[:4]
    prompt = requests[3]
    result = driver.step(StepPlan(new_requests=[NewRequest(3, prompt, GREEDY, table, 0, len(prompt))],
                                  cached_requests=cached))
    assert result.num_sampled_tokens == [1, 4, 1]
    assert result.token_ids == [reference[3][0], *reference[1][1:5], reference[2][1]]
    state = qwen3.table.requests[1]
    assert state.num_computed_tokens == len(requests[1]) + 4
    assert len(state.block_table) == -(-state.num_computed_tokens // 4)
    qwen3.step(StepPlan(finished_request_ids=[1, 2, 3]))


def test_smollm2_greedy_with_proposals_gives_the_tokens_of_plain_decoding(smollm2_folder: Path) -> None:  # noqa: F811
    executor = executor_for(smollm2_folder)
    requests = prompts(executor.get_info().vocab_size, 2, seed=7)
    reference = plain(executor, requests, 12)
    out, counts = speculated(executor, requests, 12, reference, 0.8)
    assert out == reference
    assert max(counts) > 2


def test_grammar_rows_with_proposals_give_the_tokens_of_plain_decoding(smollm2_folder: Path) -> None:  # noqa: F811
    """Accepted proposals advance the grammar, rejected ones leave no trace in it; an illegal proposal is rejected."""
    import llguidance

    executor = executor_for(smollm2_folder)
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[a-z]+( [a-z]+){2,6}\.")
    requests = {1: [1, 504, 3458, 282, 253, 1694, 30], 2: [1, 28, 29, 30, 28, 29, 30, 28]}
    for sampling in (SamplingSettings(temperature=0.0, grammar=grammar),
                     SamplingSettings(temperature=0.9, seed=5, grammar=grammar, repetition_penalty=1.3)):
        reference = plain(executor, requests, 10, sampling)
        out, counts = speculated(executor, requests, 10, reference, 0.6, sampling, seed=4)
        assert out == reference
        assert max(counts) > 2
