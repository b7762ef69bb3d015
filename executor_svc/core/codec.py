"""The executor's one translation to and from protobuf.

The core (request table, sampler, step code) works on plain values: a request's
sampling params are translated once, when it arrives in a plan, and a step's
output once, when it leaves as a StepResult.
"""

from __future__ import annotations

from executor_svc.core.types import SamplingSettings, StepOutput, TokenLogprobs
from nanoserve.v1 import executor_pb2 as pb

# The optional fields: absent ones keep SamplingSettings' defaults.
SAMPLING_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "seed", "num_logprobs",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "grammar", "num_prompt_logprobs",
)


def sampling_settings(params: pb.SamplingParams) -> SamplingSettings:
    """The fields the request set; absent ones take the proto's documented defaults (SamplingSettings')."""
    return SamplingSettings(
        **{name: getattr(params, name) for name in SAMPLING_FIELDS if params.HasField(name)},
        logit_bias=tuple(sorted(params.logit_bias.items())),
        min_tokens=params.min_tokens,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def token_logprobs(logprobs: TokenLogprobs | None) -> pb.TokenLogprobs:
    """An empty entry for a request that asked for none."""
    if logprobs is None:
        return pb.TokenLogprobs()
    return pb.TokenLogprobs(
        logprob=logprobs.logprob, top_token_ids=logprobs.top_token_ids, top_logprobs=logprobs.top_logprobs
    )


def step_result(instance_id: str, step_id: int, output: StepOutput) -> pb.StepResult:
    result = pb.StepResult(
        instance_id=instance_id,
        step_id=step_id,
        token_ids=output.token_ids,
        forward_ms=output.forward_ms,
        sample_ms=output.sample_ms,
        num_passes=output.num_passes,
    )
    if output.logprobs:
        result.logprobs.extend(map(token_logprobs, output.logprobs))
    for run in output.prompt_logprobs:
        result.prompt_logprobs.add(request_id=run.request_id, first_position=run.first_position,
                                   logprobs=map(token_logprobs, run.logprobs))
    return result
