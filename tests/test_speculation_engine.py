"""Speculative decoding through the engine over the shadow-KV executor: outputs with speculation equal those
without (the sequential reference) token for token, through prefix hits, chunked prefill, preemption, overlap,
multi-step windows, both policies, an executor restart, and with every block free and the executor empty after."""

from __future__ import annotations

import random

import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import EOS, assert_all_blocks_free
from tests.shadow_helpers import ConnectionLost, RestartingExecutor, expected, run_with_recovery

# A small vocabulary makes the shadow's tokens repeat, so n-gram proposals are sometimes right and sometimes not.
VOCAB = 6


def shadow(num_blocks: int = 48, method: str = "ngram") -> ShadowExecutor:
    return ShadowExecutor(num_blocks, 4, VOCAB, (EOS,), draft_miss_every=3 if method == "draft" else None)


def spec_config(method: str, policy: str = "nano-vllm", steps: int = 1, **overrides) -> SchedulerConfig:
    ngram = dict(ngram_min=1, ngram_max=3) if method == "ngram" else {}
    return SchedulerConfig(**{"max_num_seqs": 6, "max_num_batched_tokens": 24, "num_scheduler_steps": steps,
                              "policy": policy, "speculative": method, "num_speculative_tokens": 3, **ngram,
                              "speculative_disable_by_batch_size": 64, **overrides})


def workload(seed: int = 7, n: int = 10) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 3-30 tokens, half of them sharing a 12-token prefix (prefix-cache hits); greedy and seeded."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    prompts = [([*shared] if i % 2 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 18))]
               for i in range(n)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=rng.randint(4, 24), ignore_eos=True)
              for i in range(n)]
    return prompts, params


def check(engine: Engine, executor: ShadowExecutor, prompts, params, seqs) -> None:
    for prompt, p, seq in zip(prompts, params, seqs, strict=True):
        assert seq.completion_token_ids == expected(engine, prompt, p)
    assert_all_blocks_free(engine.block_manager)
    assert len(executor.table) == 0
    assert not engine.planner.num_blocks_sent


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
@pytest.mark.parametrize("overlap,steps", [(False, 1), (True, 1), (True, 8)], ids=["sync", "overlap", "windows"])
def test_speculation_on_equals_off_token_for_token(method: str, policy: str, overlap: bool, steps: int) -> None:
    executor = shadow(method=method)
    engine = Engine(executor, spec_config(method, policy, steps), overlap=overlap)
    prompts, params = workload()
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    check(engine, executor, prompts, params, seqs)
    counters = engine.scheduler.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert engine.block_manager.num_cached_blocks > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
def test_speculation_survives_preemption_in_a_small_cache(method: str, policy: str) -> None:
    executor = shadow(num_blocks=16, method=method)
    engine = Engine(executor, spec_config(method, policy, 1), overlap=True)
    prompts, params = workload(seed=3, n=8)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    assert engine.scheduler.num_preemptions > 0
    check(engine, executor, prompts, params, seqs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("die_at", [{3}, {4, 9}, {2, 7, 14}])
def test_speculation_survives_executor_restarts(method: str, die_at: set[int]) -> None:
    executor = RestartingExecutor(lambda: shadow(method=method), die_at)
    engine = Engine(executor, spec_config(method, "mixed", 8), overlap=True)
    prompts, params = workload(seed=11, n=8)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_with_recovery(engine)
    assert executor.restarts == len(die_at)
    check(engine, executor.inner, prompts, params, seqs)


def test_draft_speculation_needs_an_executor_with_a_draft_model() -> None:
    with pytest.raises(ValueError, match="--speculative draft needs an executor started with a draft model"):
        Engine(shadow(), spec_config("draft"))


def test_a_restarted_executor_without_its_draft_model_is_incompatible() -> None:
    from scheduler_svc.engine.engine import IncompatibleExecutor

    made = iter([shadow(method="draft"), shadow()])
    executor = RestartingExecutor(lambda: next(made), {2})
    engine = Engine(executor, spec_config("draft"))
    seq = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ConnectionLost):
        engine.step()
    with pytest.raises(IncompatibleExecutor, match="draft model"):
        engine.recover()
    engine.abort(seq)
    assert seq.is_finished and seq.finish_reason.value == "abort"
    assert_all_blocks_free(engine.block_manager)


def test_on_a_cpu_proposals_stop_above_a_few_sequences_unless_the_flag_says() -> None:
    """A CPU step costs per row from a few rows on, so by default proposals are made only in small batches there;
    an accelerator (or the flag) keeps them at any batch size."""
    from dataclasses import replace

    def drafts_while_running(executor: ShadowExecutor, **overrides: object) -> list[int]:
        engine = Engine(executor, spec_config("ngram", **overrides))
        for max_tokens in range(8, 32, 4):  # they end one after another: the batch shrinks
            engine.add_request([1, 2] * 3, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        running = []
        while engine.has_unfinished():
            before = engine.scheduler.speculator.counters.num_drafts
            engine.step()
            if engine.scheduler.speculator.counters.num_drafts > before:
                running.append(len(engine.scheduler.running))
        assert_all_blocks_free(engine.block_manager)
        return running

    cpu = drafts_while_running(shadow(), speculative_disable_by_batch_size=None)
    assert cpu and max(cpu) <= 4
    assert max(drafts_while_running(shadow(), speculative_disable_by_batch_size=6)) == 6
    accelerator = shadow()
    accelerator.info = replace(accelerator.info, device="cuda:0")
    assert max(drafts_while_running(accelerator, speculative_disable_by_batch_size=None)) == 6
