"""The step contract's proto edge (``common.step_codec``): sampling params in, plans and results both ways."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from common.step import (
    CachedRequests,
    ExecutorInfo,
    NewRequest,
    PromptLogprobs,
    SamplingSettings,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from common.step_codec import (
    info_from_proto,
    info_to_proto,
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from executor_svc.core.request_table import INVALID, PlanError, RequestTable
from nanoserve.v1 import executor_pb2 as pb
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.validation import ModelLimits, check_token_ids


def test_absent_sampling_fields_take_the_proto_defaults() -> None:
    settings = sampling_from_proto(pb.SamplingParams())
    assert settings == SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, num_logprobs=None)
    assert not settings.greedy and not settings.plain_greedy


def test_every_sampling_field_is_carried_and_zero_is_not_absent() -> None:
    params = pb.SamplingParams(temperature=0.5, top_k=7, top_p=0.25, min_p=0.125, seed=2**64 - 1, num_logprobs=3)
    assert sampling_from_proto(params) == SamplingSettings(0.5, 7, 0.25, 0.125, 2**64 - 1, 3)
    # Seed 0 is a seed, and 0 logprobs asks for the sampled token's.
    zeros = sampling_from_proto(pb.SamplingParams(temperature=0.0, seed=0, num_logprobs=0))
    assert (zeros.temperature, zeros.seed, zeros.num_logprobs) == (0.0, 0, 0)


@pytest.mark.parametrize(
    ("params", "greedy", "plain_greedy"),
    [
        (pb.SamplingParams(temperature=0.0), True, True),
        (pb.SamplingParams(temperature=1e-6), True, True),
        (pb.SamplingParams(temperature=0.0, num_logprobs=0), True, False),
        (pb.SamplingParams(temperature=0.1), False, False),
        (pb.SamplingParams(top_k=1), False, False),
    ],
)
def test_the_greedy_flags_are_worked_out_on_arrival(params: pb.SamplingParams, greedy: bool, plain_greedy: bool):
    settings = sampling_from_proto(params)
    assert (settings.greedy, settings.plain_greedy) == (greedy, plain_greedy)


def test_the_logits_processor_fields_are_carried() -> None:
    params = pb.SamplingParams(
        temperature=0.0, repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75,
        logit_bias={9: -100.0, 3: 2.5}, min_tokens=4, stop_token_ids=[7, 8], ignore_eos=True,
    )
    assert sampling_from_proto(params) == SamplingSettings(
        temperature=0.0, repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75,
        logit_bias=((3, 2.5), (9, -100.0)), min_tokens=4, stop_token_ids=(7, 8), ignore_eos=True,
    )


@pytest.mark.parametrize(
    ("params", "has_processors", "penalized"),
    [
        (pb.SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0), False, False),
        (pb.SamplingParams(temperature=0.0, stop_token_ids=[5], ignore_eos=True), False, False),
        (pb.SamplingParams(temperature=0.0, repetition_penalty=1.1), True, True),
        (pb.SamplingParams(temperature=0.0, frequency_penalty=-0.1), True, True),
        (pb.SamplingParams(temperature=0.0, logit_bias={1: 0.5}), True, False),
        (pb.SamplingParams(temperature=0.0, min_tokens=1), True, False),
    ],
)
def test_logits_processors_leave_the_greedy_fast_path(params: pb.SamplingParams, has_processors: bool,
                                                      penalized: bool) -> None:
    settings = sampling_from_proto(params)
    assert (settings.has_logits_processors, settings.penalized) == (has_processors, penalized)
    assert settings.plain_greedy is not has_processors


def new_request_plan(request_id: int, token_ids: list[int], sampling: pb.SamplingParams | None = None,
                     **fields: int) -> StepPlan:
    """A plan as the executor's servicer hands it to the request table: decoded from its message."""
    plan = pb.StepPlan(step_id=1, is_prefill=True)
    plan.new_requests.add(request_id=request_id, token_ids=token_ids, sampling=sampling, block_table=[0],
                          num_scheduled_tokens=len(token_ids), **fields)
    return plan_from_proto(plan)


def test_num_prompt_tokens_is_kept_and_defaults_to_every_token() -> None:
    table = RequestTable(num_blocks=4, block_size=16, vocab_size=100, max_model_len=64)
    table.apply(new_request_plan(1, [5, 6, 7, 8]))
    table.apply(new_request_plan(2, [5, 6, 7, 8], num_prompt_tokens=1))
    assert (table.requests[1].num_prompt_tokens, table.requests[2].num_prompt_tokens) == (4, 1)


@pytest.mark.parametrize(
    ("sampling", "fields", "message"),
    [
        (pb.SamplingParams(repetition_penalty=0.0), {}, "repetition_penalty"),
        (pb.SamplingParams(repetition_penalty=float("nan")), {}, "repetition_penalty"),
        (pb.SamplingParams(presence_penalty=2.5), {}, "presence_penalty"),
        (pb.SamplingParams(frequency_penalty=-2.5), {}, "frequency_penalty"),
        (pb.SamplingParams(logit_bias={100: 1.0}), {}, "logit_bias"),
        (pb.SamplingParams(logit_bias={3: -101.0}), {}, "logit_bias"),
        (pb.SamplingParams(temperature=float("nan")), {}, "temperature"),
        (pb.SamplingParams(temperature=float("inf")), {}, "temperature"),
        (pb.SamplingParams(temperature=-1.0), {}, "temperature"),
        (pb.SamplingParams(top_p=0.0), {}, "top_p"),
        (pb.SamplingParams(min_p=1.5), {}, "min_p"),
        (pb.SamplingParams(num_logprobs=21), {}, "num_logprobs"),
        (pb.SamplingParams(num_prompt_logprobs=1_000_000), {}, "num_prompt_logprobs"),
        (None, {"num_prompt_tokens": 5}, "prompt tokens"),
    ],
)
def test_sampling_the_executor_cannot_apply_is_refused_whole(sampling: pb.SamplingParams | None,
                                                             fields: dict[str, int], message: str) -> None:
    table = RequestTable(num_blocks=4, block_size=16, vocab_size=100, max_model_len=64)
    with pytest.raises(PlanError, match=message) as err:
        table.apply(new_request_plan(1, [5, 6, 7, 8], sampling, **fields))
    assert err.value.code == INVALID and len(table) == 0


@pytest.mark.parametrize("token_id", [-1, 100])
def test_a_negative_or_too_large_token_id_in_logit_bias_is_refused_in_process_too(token_id: int) -> None:
    # The proto's ids are unsigned; an in-process scheduler hands the settings over as they are, and -1 would bias
    # the vocabulary's last token.
    table = RequestTable(num_blocks=4, block_size=16, vocab_size=100, max_model_len=64)
    plan = new_request_plan(1, [5, 6, 7, 8])
    plan.new_requests[0].sampling = SamplingSettings(logit_bias=((token_id, 1.0),))
    with pytest.raises(PlanError, match="logit_bias"):
        table.apply(plan)
    limits = ModelLimits(vocab_size=100, max_model_len=64, block_size=16, num_blocks=4)
    for params in (SamplingParams(logit_bias={token_id: 1.0}), SamplingParams(stop_token_ids=[token_id])):
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            check_token_ids(params, limits)


def test_a_step_result_carries_tokens_timings_and_logprobs_in_order() -> None:
    asked = TokenLogprobs(-0.5, [4, 9], [-0.5, -1.25])
    output = StepResult([4, 0, 7], [asked, None, TokenLogprobs(-2.0, [], [])], forward_ms=3.5, sample_ms=0.25)
    output.instance_id, output.step_id = "abc", 12
    result = result_to_proto(output)
    assert (result.instance_id, result.step_id, list(result.token_ids)) == ("abc", 12, [4, 0, 7])
    assert (result.forward_ms, result.sample_ms) == (3.5, 0.25)
    assert list(result.logprobs) == [
        pb.TokenLogprobs(logprob=-0.5, top_token_ids=[4, 9], top_logprobs=[-0.5, -1.25]),
        pb.TokenLogprobs(),
        pb.TokenLogprobs(logprob=-2.0),
    ]


def test_a_step_result_without_logprobs_has_none() -> None:
    result = result_to_proto(StepResult([5, 6], instance_id="abc", step_id=1))
    assert list(result.token_ids) == [5, 6] and not result.logprobs


def test_settings_the_scheduler_sends_come_back_the_same() -> None:
    """Every field survives the wire, defaults are left unset (a smaller plan), and zero is not absent."""
    full = SamplingSettings(temperature=0.0, top_k=3, top_p=0.5, min_p=0.25, seed=0, num_logprobs=0,
                            repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=2.0,
                            logit_bias=((1, -2.0), (7, 3.0)), min_tokens=2, stop_token_ids=(4, 9), ignore_eos=True,
                            grammar='{"grammars": []}', num_prompt_logprobs=1)
    assert sampling_from_proto(sampling_to_proto(full)) == full
    assert sampling_to_proto(SamplingSettings()).ListFields() == []


def test_a_plan_comes_back_the_same() -> None:
    plan = StepPlan(7, False, [3], [NewRequest(5, [1, 2, 3], SamplingSettings(seed=4), [0, 1], 1, 2, 2)],
                    CachedRequests([8, 9], [4, 6], [1, 1], [0, 1], [11], [3, 3]), after_whole_step_id=6)
    assert plan_from_proto(plan_to_proto(plan)) == plan
    bare = plan_from_proto(pb.StepPlan(new_requests=[pb.NewRequest(request_id=1, token_ids=[2])]))
    assert (bare.after_whole_step_id, bare.new_requests[0].num_prompt_tokens) == (None, None)


def test_a_result_and_the_handshake_come_back_the_same() -> None:
    result = StepResult([4, 5], [TokenLogprobs(-0.5, [4], [-0.5]), TokenLogprobs(0.0)], 1.5, 0.5,
                        [PromptLogprobs(2, 1, [TokenLogprobs(-3.0, [8], [-1.0])])],
                        num_passes=0, instance_id="i", step_id=3)
    assert result_from_proto(result_to_proto(result)) == result
    assert result_from_proto(result_to_proto(StepResult(instance_id="i", step_id=4))).num_passes is None
    info = ExecutorInfo("id", "m", "LlamaForCausalLM", "bfloat16", "cpu", 100, (2, 3), 64, 16, 8, bos_token_id=0,
                        tokenizer_json="{}", chat_template="t", attention_backend="cpu")
    assert info_from_proto(info_to_proto(info)) == info
    assert info_from_proto(info_to_proto(replace(info, bos_token_id=None))).bos_token_id is None


def test_model_free_executors_load_no_torch() -> None:
    """The shadow, echo and null executors run the whole stack where torch is not installed."""
    probe = "import sys, executor_svc.fakes.shadow_server; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"
