"""The one translation between the step-plan contract's messages and ``common.step``'s dataclasses.

The scheduler's executor client encodes plans and decodes results and the handshake; the executor's servicer
does the reverse. Columns go in and out with one call each: plans and results cross here every step.
"""

from __future__ import annotations

from dataclasses import fields

from common.sampling import GenerationDefaults
from common.step import (
    CachedRequests,
    ExecutorInfo,
    LoraAdapterInfo,
    NewRequest,
    PromptLogprobs,
    SamplingSettings,
    SpecialTokens,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from nanoserve.v1 import executor_pb2 as pb

# SamplingSettings fields the proto has as ``optional`` (absent: the default), by their proto names.
OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "num_logprobs", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "grammar", "num_prompt_logprobs", "thinking_token_budget",
                     "thinking_start_token_id", "thinking_end_token_id")
DEFAULT_SAMPLING = SamplingSettings()


def sampling_to_proto(s: SamplingSettings) -> pb.SamplingParams:
    """Fields at their default are left unset (a smaller plan)."""
    msg = pb.SamplingParams(min_tokens=s.min_tokens, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                            logit_bias=dict(s.logit_bias), allowed_token_ids=s.allowed_token_ids,
                            bad_words_token_ids=[pb.TokenIds(token_ids=word) for word in s.bad_words_token_ids],
                            grammar_after_token_ids=s.grammar_after_token_ids,
                            logprob_token_ids=s.logprob_token_ids)
    for name in OPTIONAL_SAMPLING:
        value = getattr(s, name)
        if value != getattr(DEFAULT_SAMPLING, name):
            setattr(msg, name, value)
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingSettings:
    return SamplingSettings(
        **{name: getattr(msg, name) for name in OPTIONAL_SAMPLING if msg.HasField(name)},
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in msg.bad_words_token_ids),
        grammar_after_token_ids=tuple(msg.grammar_after_token_ids),
        logprob_token_ids=tuple(msg.logprob_token_ids),
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    msg = pb.StepPlan(step_id=plan.step_id, is_prefill=plan.is_prefill,
                      finished_request_ids=plan.finished_request_ids, after_whole_step_id=plan.after_whole_step_id)
    for new in plan.new_requests:
        msg.new_requests.add(request_id=new.request_id, token_ids=new.token_ids,
                             sampling=sampling_to_proto(new.sampling), block_table=new.block_table,
                             num_computed_tokens=new.num_computed_tokens,
                             num_scheduled_tokens=new.num_scheduled_tokens, num_prompt_tokens=new.num_prompt_tokens,
                             lora_id=new.lora_id)
    c = plan.cached_requests
    if c.request_ids:
        cached = msg.cached_requests
        cached.request_ids.extend(c.request_ids)
        cached.num_computed_tokens.extend(c.num_computed_tokens)
        cached.num_scheduled_tokens.extend(c.num_scheduled_tokens)
        cached.num_new_blocks.extend(c.num_new_blocks)
        cached.new_block_ids.extend(c.new_block_ids)
        cached.num_decode_steps.extend(c.num_decode_steps)
        cached.num_draft_tokens.extend(c.num_draft_tokens)
        cached.draft_token_ids.extend(c.draft_token_ids)
    return msg


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    c = msg.cached_requests
    return StepPlan(
        step_id=msg.step_id,
        is_prefill=msg.is_prefill,
        finished_request_ids=list(msg.finished_request_ids),
        new_requests=[
            NewRequest(new.request_id, list(new.token_ids), sampling_from_proto(new.sampling), list(new.block_table),
                       new.num_computed_tokens, new.num_scheduled_tokens,
                       new.num_prompt_tokens if new.HasField("num_prompt_tokens") else None, new.lora_id)
            for new in msg.new_requests
        ],
        cached_requests=CachedRequests(list(c.request_ids), list(c.num_computed_tokens), list(c.num_scheduled_tokens),
                                       list(c.num_new_blocks), list(c.new_block_ids), list(c.num_decode_steps),
                                       list(c.num_draft_tokens), list(c.draft_token_ids)),
        after_whole_step_id=msg.after_whole_step_id if msg.HasField("after_whole_step_id") else None,
    )


def _logprobs_to_proto(lp: TokenLogprobs | None) -> pb.TokenLogprobs:
    """An empty entry for a request that asked for none."""
    if lp is None:
        return pb.TokenLogprobs()
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs,
                            rank=lp.rank)


def _logprobs_from_proto(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, list(msg.top_token_ids), list(msg.top_logprobs),
                         msg.rank if msg.HasField("rank") else None)


def result_to_proto(result: StepResult) -> pb.StepResult:
    msg = pb.StepResult(instance_id=result.instance_id, step_id=result.step_id, token_ids=result.token_ids,
                        forward_ms=result.forward_ms, sample_ms=result.sample_ms, num_passes=result.num_passes,
                        num_sampled_tokens=result.num_sampled_tokens)
    if result.logprobs:
        msg.logprobs.extend(map(_logprobs_to_proto, result.logprobs))
    for run in result.prompt_logprobs:
        msg.prompt_logprobs.add(request_id=run.request_id, first_position=run.first_position,
                                logprobs=map(_logprobs_to_proto, run.logprobs))
    return msg


def result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(
        list(msg.token_ids),
        [_logprobs_from_proto(lp) for lp in msg.logprobs] if msg.logprobs else [],
        msg.forward_ms, msg.sample_ms,
        [PromptLogprobs(run.request_id, run.first_position, [_logprobs_from_proto(lp) for lp in run.logprobs])
         for run in msg.prompt_logprobs],
        msg.num_passes if msg.HasField("num_passes") else None,
        msg.instance_id, msg.step_id, list(msg.num_sampled_tokens),
    )


INFO_FIELDS = ("instance_id", "model_id", "architecture", "dtype", "device", "vocab_size", "max_model_len",
               "block_size", "num_blocks", "tensor_parallel_size", "tokenizer_json", "chat_template",
               "attention_backend", "max_lora_rank", "runtime_lora", "draft_model_id")


def info_to_proto(info: ExecutorInfo) -> pb.ExecutorInfo:
    return pb.ExecutorInfo(**{name: getattr(info, name) for name in INFO_FIELDS},
                           eos_token_ids=info.eos_token_ids, bos_token_id=info.bos_token_id,
                           lora_adapters=map(lora_to_proto, info.lora_adapters),
                           special_tokens=_optionals_to_proto(info.special_tokens, pb.SpecialTokens),
                           generation_defaults=_optionals_to_proto(info.generation_defaults, pb.GenerationDefaults))


def info_from_proto(msg: pb.ExecutorInfo) -> ExecutorInfo:
    return ExecutorInfo(**{name: getattr(msg, name) for name in INFO_FIELDS},
                        eos_token_ids=tuple(msg.eos_token_ids),
                        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
                        lora_adapters=tuple(map(lora_from_proto, msg.lora_adapters)),
                        special_tokens=_optionals_from_proto(msg, "special_tokens", SpecialTokens),
                        generation_defaults=_optionals_from_proto(msg, "generation_defaults", GenerationDefaults))


def _optionals_to_proto(value: object | None, message: type) -> object | None:
    """A dataclass of optional fields as its message (None: absent); its None fields stay unset."""
    return None if value is None else message(**{f.name: getattr(value, f.name) for f in fields(value)})


def _optionals_from_proto(msg: pb.ExecutorInfo, name: str, cls: type) -> object | None:
    if not msg.HasField(name):
        return None
    part = getattr(msg, name)
    return cls(**{f.name: getattr(part, f.name) if part.HasField(f.name) else None for f in fields(cls)})


def lora_to_proto(adapter: LoraAdapterInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_id=adapter.lora_id, name=adapter.name, path=adapter.path, rank=adapter.rank)


def lora_from_proto(msg: pb.LoraAdapter) -> LoraAdapterInfo:
    return LoraAdapterInfo(msg.lora_id, msg.name, msg.path, msg.rank)
