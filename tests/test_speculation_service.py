"""Speculative decoding through the in-process scheduler service over the shadow executor: a resumed stream gives
the rest of the undisturbed tokens, n > 1 choices do not speculate, and GetStats and /metrics count proposals."""

from __future__ import annotations

import httpx
import pytest

from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import collect, free_port, in_process_scheduler, token_request
from tests.test_metrics import parse, value
from tests.test_scheduler_resume import generate, resumed
from tests.test_service_options import VOCAB, run, shadow

# Proposals at every batch size: the shadow says it runs on a CPU, where they would stop above a few sequences.
SPEC = {"draft": dict(speculative="draft", speculative_disable_by_batch_size=64),
        "ngram": dict(speculative="ngram", ngram_min=1, ngram_max=2, speculative_disable_by_batch_size=64)}


def executor(method: str):
    return shadow(draft_miss_every=3) if method == "draft" else shadow(vocab_size=5)


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_resumed_stream_with_speculation_gives_the_rest_of_the_undisturbed_tokens(method: str, seed: int | None):
    vocab = VOCAB if method == "draft" else 5
    prompt, max_tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 40
    request = token_request(prompt, max_tokens, ignore_eos=True)
    if seed is not None:
        request.sampling.seed, request.sampling.temperature = seed, 0.8
    expected = reference_generate(prompt, max_tokens, vocab, {0}, True, seed)
    cuts = [0, 3, 21]

    async def work(stub):
        got = [await generate(stub, resumed(request, expected[:k])) for k in cuts]
        return got, await stub.GetStats(pb.GetStatsRequest())

    got, stats = run(executor(method), work, **SPEC[method])
    for k, out in zip(cuts, got, strict=True):
        assert out.token_ids == expected[k:], f"resumed after {k} tokens"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), max_tokens)
    assert stats.num_spec_drafts > 0 and stats.num_spec_accepted_tokens > 0
    assert stats.spec_acceptance_rate == pytest.approx(stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens)


def test_choices_of_n_above_1_do_not_speculate():
    request = token_request([5, 6, 7, 8], 8, ignore_eos=True)
    request.sampling.seed, request.sampling.n, request.sampling.temperature = 3, 3, 0.8

    async def work(stub):
        out = [r async for r in stub.Generate(request)]
        return out, await stub.GetStats(pb.GetStatsRequest())

    out, stats = run(executor("draft"), work, **SPEC["draft"])
    assert sum(len(r.token_ids) for r in out) == 3 * 8
    assert stats.num_spec_drafts == 0


def test_metrics_count_proposals_and_acceptance_by_position():
    import asyncio

    async def main():
        port = free_port()
        async with in_process_scheduler(executor("draft"), metrics_port=port, **SPEC["draft"]) as s:
            got = collect([r async for r in s.stub.Generate(token_request([9, 8, 7], 20, ignore_eos=True))])
            stats = await s.stub.GetStats(pb.GetStatsRequest())
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            return got, stats, parse(text)

    got, stats, samples = asyncio.run(main())
    assert got.token_ids == reference_generate([9, 8, 7], 20, VOCAB, {0}, True)
    assert value(samples, "spec_decode_num_drafts_total") == stats.num_spec_drafts > 0
    assert value(samples, "spec_decode_num_draft_tokens_total") == stats.num_spec_draft_tokens
    accepted = value(samples, "spec_decode_num_accepted_tokens_total")
    assert accepted == stats.num_spec_accepted_tokens > 0
    per_position = [value(samples, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
