"""Speculative decoding through the two-service stack (an executor process and a scheduler process over gRPC) on the
embedded SmolLM2 in float32: with n-gram proposals from the scheduler, and with the executor's early-exit draft, the
greedy tokens are transformers' own, the proposals were really verified, and every KV block is free after."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.model_fixtures import hf_greedy, smollm2_folder  # noqa: F401
from tests.service_fixtures import HOST, Stack, assert_idle, free_port, running_stack, stream, token_request

MAX_NEW_TOKENS = 24
# A list the model repeats (copy-heavy: n-gram proposals get accepted), a prompt sharing its prefix, and random ids.
LIST = [330, 1345, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28, 9104, 28, 1345, 28, 5026, 28, 3829, 28, 2335, 28]
PROMPTS = [LIST, LIST + [9104, 28], [4012, 77, 9, 31005, 2816, 640, 17, 3305]]
# The scheduler's flags and the executor's per method; the early exit keeps 24 of the model's 30 layers.
METHODS = {
    "ngram": ({"speculative": "ngram", "num_speculative_tokens": 4, "ngram_min": 2, "ngram_max": 4}, []),
    "draft": ({"speculative": "draft", "num_speculative_tokens": 3}, ["--speculative-draft-layers", "24"]),
}


@pytest.fixture(scope="module")
def reference(smollm2_folder: Path) -> list[list[int]]:  # noqa: F811
    return hf_greedy(smollm2_folder, PROMPTS, MAX_NEW_TOKENS, stop_at_eos=False)


@pytest.fixture(params=sorted(METHODS))
def stack(request: pytest.FixtureRequest, smollm2_folder: Path, tmp_path: Path) -> Iterator[Stack]:  # noqa: F811
    scheduler_flags, executor_flags = METHODS[request.param]
    port = free_port()
    argv = [sys.executable, "-m", "executor_svc", "--host", HOST, "--port", str(port), "--model", str(smollm2_folder),
            "--dtype", "float32", "--kv-cache-memory", "64M", "--block-size", "8", "--threads", "2", *executor_flags]
    with running_stack(argv, tmp_path, port, **scheduler_flags) as running:
        yield running


def test_greedy_float32_tokens_with_speculation_are_transformers_own(stack: Stack, reference: list[list[int]]):
    async def all_at_once() -> list[list[int]]:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            requests = []
            for prompt in PROMPTS:
                request = token_request(prompt, MAX_NEW_TOKENS, ignore_eos=True)
                request.sampling.temperature = 0.0
                requests.append(request)
            return [c.token_ids for c in await asyncio.gather(*(stream(stub, r) for r in requests))]

    assert asyncio.run(all_at_once()) == reference
    stats = assert_idle(stack.stub)
    assert stats.num_spec_drafts > 0 and stats.num_spec_draft_tokens >= stats.num_spec_drafts
