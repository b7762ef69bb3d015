"""A logprob's rank, as vLLM counts it: the tokens at least as likely in the raw distribution, itself included (ties
share the last of their ranks), for sampled and prompt tokens alike; it crosses the step contract and the public API,
and the generate route and prompt logprobs show it where the token is not among the alternatives asked for."""

from __future__ import annotations

import torch

from common.step import SamplingSettings, StepResult, TokenLogprobs
from common.step_codec import result_from_proto, result_to_proto
from executor_svc.sample.prompt_logprobs import ScoredRun, prompt_logprobs
from executor_svc.sample.sampler import Sampler
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.codec import to_response
from scheduler_svc.api.http.generate_api.output import candidates
from scheduler_svc.api.http.responses import prompt_logprobs as http_prompt_logprobs
from scheduler_svc.core.outputs import RequestOutput

LOGITS = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])


def test_a_sampled_token_outside_the_alternatives_has_its_rank_in_the_whole_vocabulary() -> None:
    row = SamplingSettings(temperature=0.0, num_logprobs=1, allowed_token_ids=(3,))  # the sampler may take only 3
    output = Sampler(seed=0)(LOGITS.clone(), [row], [1], [_Tokens()])
    entry = output.logprobs[0]
    assert output.token_ids == [3] and entry.rank == 4 and entry.top_token_ids == [0], "0, 1 and 2 are likelier"
    greedy = Sampler(seed=0)(LOGITS.clone(), [SamplingSettings(temperature=0.0, num_logprobs=0)], [1])
    assert greedy.logprobs[0].rank == 1
    tied = Sampler(seed=0)(torch.tensor([[5.0, 5.0, 3.0]]), [SamplingSettings(temperature=0.0, num_logprobs=0)], [1])
    assert tied.token_ids == [0] and tied.logprobs[0].rank == 2, "ties share the last of their ranks, as vLLM's"


def test_prompt_tokens_are_ranked_too() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0], [0.0, 1.0, 2.0]])
    scored = prompt_logprobs(logits, [ScoredRun(7, 1, 0, [2, 2], 1)])[0]
    assert [e.rank for e in scored.logprobs] == [3, 1]


def test_the_rank_crosses_the_step_contract_and_the_public_api() -> None:
    result = StepResult([3], [TokenLogprobs(-3.0, [0], [-0.5], rank=4)])
    assert result_from_proto(result_to_proto(result)).logprobs[0].rank == 4
    assert result_from_proto(result_to_proto(StepResult([3], [TokenLogprobs(-3.0)]))).logprobs[0].rank is None
    response = to_response("r", [RequestOutput(token_ids=[3], logprobs=[TokenLogprobs(-3.0, [0], [-0.5], rank=4)])])
    assert response.logprobs[0].rank == 4 and not pb.TokenLogprob().HasField("rank")


def test_generate_and_prompt_logprobs_show_the_rank_of_a_token_outside_the_alternatives() -> None:
    lp = TokenLogprobs(-3.0, [0, 1], [-0.5, -1.0], rank=4)
    assert [(c.token_id, c.rank) for c in candidates(3, lp, 2)] == [(3, 4), (0, 1)]
    shown = http_prompt_logprobs(([9, 3], [lp]), None)
    assert shown[1][3].rank == 4 and shown[1][0].rank == 1


class _Tokens:
    """A request's tokens as the logits processors read them."""

    token_ids = [1]
    num_prompt_tokens = 1
    token_counts = token_masks = thinking_count = matcher = None
