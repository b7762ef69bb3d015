"""allowed_token_ids and bad_words through the public gRPC API on the embedded SmolLM2 (float32, greedy): a word the
unconstrained completion holds never appears once banned, and a request restricted to a few tokens samples only
those, streamed one step a plan and read whole in the scheduler's windows of 8, with a step in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client.request_builder import build_request
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.service_fixtures import assert_idle_async, collect, in_process_scheduler

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def executor(smollm2_folder: Path) -> ModelExecutor:  # noqa: F811
    return ModelExecutor(ExecutorOptions(dtype="float32", model=str(smollm2_folder), threads=2,
                                         kv_cache_memory=64 << 20))


def answers(executor: ModelExecutor, requests: list[pb.GenerateRequest]) -> list[tuple[str, list[int]]]:
    """Each request streamed (one step a plan) and read whole (windows), all at once; both must agree."""
    async def main() -> list[tuple[str, list[int]]]:
        async with in_process_scheduler(executor) as server:
            streams = [server.stub.Generate(r) for r in requests]
            whole, streamed = await asyncio.gather(
                asyncio.gather(*(server.stub.GenerateOnce(r) for r in requests)),
                asyncio.gather(*(collect_stream(s) for s in streams)))
            await assert_idle_async(server.stub)
        out = [(r.text, list(r.token_ids)) for r in whole]
        assert out == [(s.text, s.token_ids) for s in streamed]
        return out

    return asyncio.run(main())


async def collect_stream(call) -> object:
    return collect([r async for r in call])


def test_a_banned_word_leaves_the_text_and_only_allowed_tokens_are_sampled(executor: ModelExecutor) -> None:
    tokenizer = ModelTokenizer.from_info(executor.get_info())
    yes_no = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no", " maybe")]
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [build_request(PROMPT, **greedy),
                build_request(PROMPT, bad_words=["Paris"], **greedy),
                build_request(PROMPT, bad_words=["Paris", "France", "the"], **greedy),
                build_request("Is the sky blue? Answer:", max_tokens=6, temperature=0.0, allowed_token_ids=yes_no),
                build_request("Is the sky blue? Answer:", max_tokens=6, temperature=1.0, seed=4,
                              allowed_token_ids=yes_no)]
    (free, _), (banned, banned_ids), (several, _), (_, greedy_ids), (_, sampled_ids) = answers(executor, requests)
    assert "Paris" in free, free
    assert "Paris" not in banned and banned_ids != [], banned
    assert not {"Paris", "France"} & set(several.split()) and " the " not in several, several
    assert set(greedy_ids) <= set(yes_no) and set(sampled_ids) <= set(yes_no)
    assert len(greedy_ids) == len(sampled_ids) == 6
