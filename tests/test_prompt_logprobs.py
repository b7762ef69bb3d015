"""prompt_logprobs: every prompt token's logprob given the tokens before it, as transformers computes them.

Float32 on the embedded SmolLM2, with chunked prefill (a small token budget splits the prompt across steps) and
through the public gRPC API; a prompt that asks skips the prefix cache, so a repeat is scored in full again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.service_fixtures import assert_idle_async, in_process_scheduler

PROMPTS = [list(range(1000, 1040)), [504, 6376, 28, 7042, 30, 198, 1000, 1001, 1002, 17]]
TOP = 3


@pytest.fixture(scope="module")
def reference(smollm2_folder: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: F811
    """Per prompt: transformers' logprob of each prompt token from the second on, and its top-TOP ids."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)[:-1]
            out.append((logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1),
                        logprobs.topk(TOP, dim=-1).indices))
    return out


def executor(folder: Path) -> ModelExecutor:
    return ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), threads=2, block_size=16,
                                         kv_cache_memory=64 << 20))


def assert_matches(got_logprobs: list[float], got_top: list[list[int]], expected) -> None:
    logprobs, top = expected
    assert torch.allclose(torch.tensor(got_logprobs), logprobs, atol=1e-3)
    # Ties aside, the most likely alternative is the same token.
    assert [t[0] for t in got_top] == top[:, 0].tolist()


def test_prompt_logprobs_match_transformers_across_prefill_chunks(smollm2_folder: Path, reference) -> None:  # noqa: F811
    engine = Engine(executor(smollm2_folder), SchedulerConfig(max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    seqs = [engine.add_request(prompt, params) for prompt in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    engine.step()
    for seq, expected in zip(seqs, reference, strict=True):
        assert len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1
        scored = seq.prompt_logprobs
        assert_matches([lp.logprob for lp in scored], [list(lp.top_token_ids) for lp in scored], expected)
        assert all(len(lp.top_token_ids) == TOP for lp in seq.prompt_logprobs)
    assert_all_blocks_free(engine.block_manager)


def test_prompt_logprobs_over_grpc_come_with_the_first_response_every_time(
    smollm2_folder: Path, reference  # noqa: F811
) -> None:
    request = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=PROMPTS[0]), prompt_logprobs=TOP,
                                 stopping=pb.StoppingOptions(max_tokens=3, ignore_eos=True))
    request.sampling.temperature = 0.0

    async def run():
        async with in_process_scheduler(executor(smollm2_folder)) as s:
            first = [r async for r in s.stub.Generate(request)]
            again = await s.stub.GenerateOnce(request)
            plain = await s.stub.GenerateOnce(pb.GenerateRequest(tokens=request.tokens, sampling=request.sampling,
                                                                 stopping=request.stopping))
            await assert_idle_async(s.stub)
            return first, again, plain

    first, again, plain = asyncio.run(run())
    for response in (first[0], again):
        scored = list(response.prompt_logprobs)
        assert [lp.token_id for lp in scored] == PROMPTS[0][1:]
        assert_matches([lp.logprob for lp in scored], [[t.token_id for t in lp.top] for lp in scored], reference[0])
    assert not any(r.prompt_logprobs for r in first[1:]), "prompt logprobs belong to the first response only"
    assert again.usage.cached_prompt_tokens == 0, "a prompt that asks must not be served from the prefix cache"
    assert not plain.prompt_logprobs
    assert list(again.token_ids) == list(plain.token_ids), "scoring the prompt changed the completion"
