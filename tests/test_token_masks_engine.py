"""allowed_token_ids and bad words through the scheduler's engine on a tiny random-weight Llama (float32): sampled
tokens never leave the allowed ids, and greedy output under bad words is the unconstrained output up to where a word
would complete, then never completes one; the same tokens one step at a time, in multi-step windows, with overlap,
across preemption, an executor restart and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.bad_words import first_banned
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import TINY_VOCAB, tiny_model_folders  # noqa: F401
from tests.shadow_helpers import RestartingExecutor, run_with_recovery

GENERATOR = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(3, TINY_VOCAB, (n,), generator=GENERATOR).tolist() for n in (6, 13, 9, 20)]
ALLOWED = sorted(torch.randperm(TINY_VOCAB, generator=GENERATOR)[:12].tolist())
MAX_TOKENS = 24
# (overlap, num_scheduler_steps): one step at a time, windows, windows with a step in flight.
RUNS = {"sync": (False, 1), "multi-step": (False, 4), "multi-step-overlap": (True, 4)}
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 KV heads of 16, float32, 4 tokens a block


@pytest.fixture(scope="module")
def executor(tiny_model_folders: dict[str, Path]) -> ModelExecutor:  # noqa: F811
    return ModelExecutor(ExecutorOptions(dtype="float32", model=str(tiny_model_folders["llama"]), threads=2,
                                         block_size=4, kv_cache_memory=256 * BLOCK_BYTES))


def generate(engine: Engine, params: list[SamplingParams]) -> list[list[int]]:
    tokens = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert_all_blocks_free(engine.block_manager)
    return tokens


def engine_of(executor: ModelExecutor, run: str, **config: object) -> Engine:
    overlap, steps = RUNS[run]
    executor.reset()  # a new engine starts from a clean executor, as a new scheduler does
    return Engine(executor, SchedulerConfig(num_scheduler_steps=steps, **config), overlap=overlap)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_sampled_tokens_never_leave_the_allowed_ids(executor: ModelExecutor, run: str) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=ALLOWED),
              SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True,
                             allowed_token_ids=ALLOWED),
              SamplingParams(temperature=1.5, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True,
                             allowed_token_ids=ALLOWED[:3]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    tokens = generate(engine_of(executor, run), params)
    assert set(tokens[0] + tokens[1]) <= set(ALLOWED) and set(tokens[2]) <= set(ALLOWED[:3])
    assert len(set(tokens[1])) > 1 and len(set(tokens[2])) > 1, "sampling never left one token"
    assert not set(tokens[3]) <= set(ALLOWED), "the unconstrained row was restricted too"
    reference = generate(engine_of(executor, "sync"), [params[0], params[1], params[3], params[3]])
    assert [tokens[0], tokens[1], tokens[3]] == [reference[0], reference[1], reference[3]]


@pytest.fixture(scope="module")
def unconstrained(executor: ModelExecutor) -> list[list[int]]:
    return generate(engine_of(executor, "sync"), [greedy() for _ in PROMPTS])


def greedy(bad_words: list[list[int]] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words_token_ids=bad_words or [])


def words_from(completion: list[int]) -> list[list[int]]:
    """Bad words the unconstrained completion holds: a two-token one at its 5th token, a one-token one at its 11th
    (banned everywhere, so it may bite earlier), and one of three tokens it never holds."""
    return [completion[4:6], [completion[10]], [completion[1], completion[0], completion[0]]]


def check_diverted(free: list[int], constrained: list[int], words: list[list[int]]) -> None:
    """Equal up to where the unconstrained completion would complete a word, another token there, none after."""
    at = first_banned(free, words)
    assert at is not None and at <= 10
    assert constrained[:at] == free[:at] and constrained[at] != free[at]
    assert first_banned(constrained, words) is None
    assert len(constrained) == MAX_TOKENS


@pytest.mark.parametrize("run", sorted(RUNS))
def test_greedy_output_turns_away_where_a_bad_word_would_complete(executor: ModelExecutor, run: str,
                                                                  unconstrained: list[list[int]]) -> None:
    words = [words_from(free) for free in unconstrained]
    # The last request has none: its tokens stay those of the unconstrained run.
    tokens = generate(engine_of(executor, run), [greedy(w) for w in words[:-1]] + [greedy()])
    for free, constrained, w in zip(unconstrained[:-1], tokens[:-1], words, strict=False):
        check_diverted(free, constrained, w)
    assert tokens[-1] == unconstrained[-1]
    if run != "sync":
        assert tokens == generate(engine_of(executor, "sync"), [greedy(w) for w in words[:-1]] + [greedy()])


def test_bad_words_hold_across_preemption_and_an_executor_restart(executor: ModelExecutor,
                                                                  unconstrained: list[list[int]]) -> None:
    """A cache too small for the batch preempts requests, and the executor loses every request twice: each comes back
    as a new request whose completion, after num_prompt_tokens, is where its words are matched."""
    words = [words_from(free) for free in unconstrained]
    params = [greedy(w) for w in words]
    expected = generate(engine_of(executor, "sync"), params)
    for free, constrained, w in zip(unconstrained, expected, words, strict=True):
        check_diverted(free, constrained, w)
    small = ModelExecutor(ExecutorOptions(dtype="float32", model=str(executor.folder), threads=2, block_size=4,
                                          kv_cache_memory=14 * BLOCK_BYTES))
    engine = Engine(small, SchedulerConfig(num_scheduler_steps=4))
    assert generate(engine, params) == expected
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted"

    def restarted() -> ModelExecutor:
        executor.reset()  # what a restarted executor holds: nothing
        return executor

    engine = Engine(RestartingExecutor(restarted, {4, 9}), SchedulerConfig(num_scheduler_steps=4))
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    run_with_recovery(engine)
    assert [seq.completion_token_ids for seq in seqs] == expected
    assert_all_blocks_free(engine.block_manager)


def test_speculation_never_accepts_a_banned_proposal(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                     unconstrained: list[list[int]]) -> None:
    """The served model as its own draft proposes the unconstrained tokens (a draft applies no processors), so every
    proposal rejected is one a bad word banned; the tokens are those of decoding without speculation."""
    folder = str(tiny_model_folders["llama"])
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=folder, threads=2, block_size=4,
                                             kv_cache_memory=256 * BLOCK_BYTES, speculative_model=folder))
    words = [words_from(free) for free in unconstrained]
    params = [greedy(w) for w in words]
    off = generate(engine_of(executor, "sync"), params)
    for run in ("sync", "multi-step-overlap"):
        engine = engine_of(executor, run, speculative="draft", num_speculative_tokens=3,
                           speculative_disable_by_batch_size=len(PROMPTS))
        assert generate(engine, params) == off
        counters = engine.scheduler.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
    for free, constrained, w in zip(unconstrained, off, words, strict=True):
        check_diverted(free, constrained, w)
