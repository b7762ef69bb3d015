"""Greedy float32 on the embedded SmolLM2 through the scheduler's engine: speculation on (n-gram, and an early-exit
draft of the model's first layers) gives exactly the tokens of speculation off, with overlap and windows, prefix
hits and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import smollm2_folder  # noqa: F401

# Copy-heavy prompts (a list to repeat), one sharing the other's prefix, one longer than the chunk budget.
LIST = [330, 1345, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28, 9104, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28]
PROMPTS = [LIST, LIST + [9104, 28], [1, 2, 3, 4, 5, 6, 7, 8] * 5]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_float32_output_with_speculation_equals_without(smollm2_folder: Path, method: str):  # noqa: F811
    draft = {"speculative_draft_layers": 12} if method == "draft" else {}
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(smollm2_folder), block_size=4,
                                             kv_cache_memory=24 << 20, threads=2, **draft))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = [c.token_ids for c in Engine(executor).generate(PROMPTS, params)]
    ngram = dict(ngram_min=2, ngram_max=4) if method == "ngram" else {}
    config = SchedulerConfig(max_num_batched_tokens=32, num_scheduler_steps=8, speculative=method,
                             num_speculative_tokens=4, **ngram)
    engine = Engine(executor, config, overlap=True)
    on = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert on == off
    counters = engine.scheduler.speculator.counters
    assert counters.num_drafts > 0
    if method == "ngram":  # the list repeats: its proposals are accepted (a 12-layer early exit's may all miss)
        assert counters.num_accepted_tokens > 0
    assert_all_blocks_free(engine.block_manager)


def test_structured_output_logprobs_and_penalties_speculate_with_the_tokens_of_plain_decoding(
        smollm2_folder: Path) -> None:  # noqa: F811
    """Requests the executor samples with more than a temperature (a regex grammar, penalties and logit bias, logprobs,
    seeded sampling) propose n-gram tokens too, and get exactly the tokens and logprobs of speculation off."""
    from nanoserve.v1 import generation_pb2 as pb
    from scheduler_svc.api.structured import compile_grammar
    from scheduler_svc.core.tokenizer import ModelTokenizer

    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(smollm2_folder), block_size=4,
                                             kv_cache_memory=24 << 20, threads=2))
    tokenizer = ModelTokenizer.from_info(executor.get_info())
    grammar = compile_grammar(pb.StructuredOutput(regex=r"(cat|dog)(, (cat|dog)){11}"), tokenizer,
                              executor.get_info().vocab_size)
    words = tokenizer.encode("Repeat the list: cat, dog, cat, dog, cat, dog, cat, dog. The list: cat, dog, cat, dog")
    params = [SamplingParams(temperature=0.0, max_tokens=40, grammar=grammar),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, repetition_penalty=1.05,
                             logit_bias={28: 0.5}),
              SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, min_tokens=4)]
    prompts = [words, LIST, LIST]

    def run(engine: Engine) -> list[tuple[list[int], list]]:
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens, logprobs = outputs.setdefault(out.seq.seq_id, ([], []))
                tokens += out.token_ids
                logprobs += [(lp.logprob, lp.top_token_ids) for lp in out.logprobs or [] if lp is not None]
        assert all(seq.speculation is not None for seq in seqs) or engine.scheduler.speculator is None
        assert_all_blocks_free(engine.block_manager)
        return [outputs[seq.seq_id] for seq in seqs]

    off = run(Engine(executor))
    executor.reset()  # the last step's finished requests were never sent to it: a new engine starts over
    config = SchedulerConfig(num_scheduler_steps=8, speculative="ngram", num_speculative_tokens=4, ngram_min=2,
                             ngram_max=4)
    engine = Engine(executor, config, overlap=True)
    on = run(engine)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    assert [[top for _, top in lps] for _, lps in on] == [[top for _, top in lps] for _, lps in off]
    assert [lp for lp, _ in on[1][1]] == pytest.approx([lp for lp, _ in off[1][1]], abs=1e-4)
    assert len(on[1][1]) == 24
    text = tokenizer.decode(on[0][0])
    assert text.startswith(("cat", "dog")) and text.count(",") == 11, text
    assert engine.scheduler.speculator.counters.num_accepted_tokens > 0
