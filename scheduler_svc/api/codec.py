"""The scheduler's one translation to and from protobuf: public requests in, responses out, executor results in.

The core (scheduler, block manager, sequence, output processing) sees only the plain objects made
here, and the planner's plans become StepPlan messages here. ``prepare`` also names each refusal by the
GenerateRequest field a caller sets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from nanoserve.v1 import executor_pb2
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.structured import compile_grammar
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.outputs import RequestOutput, TokenLogprobs
from scheduler_svc.core.planner import Plan
from scheduler_svc.core.sampling import DEFAULTS, SamplingParams
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from scheduler_svc.core.validation import (
    ModelLimits,
    check_fits_cache,
    check_prompt,
    check_resume,
    check_token_ids,
    completion_budget,
)
from scheduler_svc.engine.stats import LoopStats

# Engine and SamplingParams field names -> the GenerateRequest field a caller sets.
PROTO_FIELD = {
    "token_ids": "tokens.token_ids",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "logprobs": "sampling.logprobs",
    "max_tokens": "stopping.max_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "logit_bias": "sampling.logit_bias",
    "n": "sampling.n",
    "min_tokens": "stopping.min_tokens",
}
# Fields of the GenerateRequest itself that SamplingParams holds.
OPTIONAL_REQUEST = ("skip_special_tokens", "prompt_logprobs")
FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Completion tokens a client resumes with (GenerateRequest.resume); they follow the prompt.
    resumed_token_ids: list[int] = field(default_factory=list)
    # Tokens each choice gathers before its stream carries them (GenerateRequest.stream_interval); None: the
    # server's --stream-interval.
    stream_interval: int | None = None


def public_error(error: InvalidRequest) -> InvalidRequest:
    """The same refusal, naming the field as a caller spells it in GenerateRequest."""
    return InvalidRequest(PROTO_FIELD.get(error.field, error.field), error.reason)


def truncated(token_ids: list[int], request: pb.GenerateRequest) -> list[int]:
    """The last ``truncate_prompt_tokens`` of the prompt, when asked (vLLM's option of that name)."""
    if not request.HasField("truncate_prompt_tokens"):
        return token_ids
    keep = request.truncate_prompt_tokens
    if keep < 1:
        raise InvalidRequest("truncate_prompt_tokens", f"must be >= 1, got {keep}")
    return token_ids[-keep:]


def stream_interval(request: pb.GenerateRequest) -> int | None:
    """The request's own stream interval, when it sets one."""
    if not request.HasField("stream_interval"):
        return None
    if request.stream_interval < 1:
        raise InvalidRequest("stream_interval", f"must be >= 1, got {request.stream_interval}")
    return request.stream_interval


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: ModelTokenizer | None) -> list[int]:
    """The prompt as token ids, whichever form it came in (checked against the model later)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "no prompt set; send text, chat or tokens")
    if kind == "tokens":
        return list(request.tokens.token_ids)
    if tokenizer is None:
        raise InvalidRequest(kind, "this executor has no tokenizer; send the prompt as tokens")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "the prompt is empty")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
    else:
        chat = request.chat
        messages = [ChatMessage(m.role, m.content) for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        token_ids = tokenizer.encode_chat(messages, add_generation_prompt)
    if not token_ids:
        raise InvalidRequest(kind, "the prompt encodes to no tokens")
    return token_ids


# Fields whose absence means their default (proto3 optional), as SamplingParams names them.
OPTIONAL_SAMPLING = ("temperature", "top_p", "seed", "logprobs", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "n")
OPTIONAL_STOPPING = ("ignore_eos", "min_tokens", "include_stop_str_in_output")


def tokenize(request: pb.TokenizeRequest, tokenizer: ModelTokenizer | None) -> list[int]:
    """The Tokenize RPC: the ids Generate would see for this text or conversation (empty text is fine here)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "nothing to tokenize; send text or chat")
    if tokenizer is None:
        raise InvalidRequest(kind, "this executor has no tokenizer")
    if kind == "text":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return tokenizer.encode(request.text, add_special_tokens=add_special)
    chat = request.chat
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return tokenizer.encode_chat([ChatMessage(m.role, m.content) for m in chat.messages], add_generation_prompt)


def detokenize(request: pb.DetokenizeRequest, tokenizer: ModelTokenizer | None, vocab_size: int) -> str:
    if tokenizer is None:
        raise InvalidRequest("token_ids", "this executor has no tokenizer")
    bad = next((i for i, t in enumerate(request.token_ids) if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("token_ids", f"token id {request.token_ids[bad]} at position {bad} is outside the "
                                          f"vocabulary [0, {vocab_size})")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)


def sampling_params(request: pb.GenerateRequest, budget: int, grammar: str | None = None) -> SamplingParams:
    """Unset fields take ``sampling.DEFAULTS`` (SamplingParams' own defaults)."""
    s, stopping = request.sampling, request.stopping
    given = {name: getattr(s, name) for name in OPTIONAL_SAMPLING if s.HasField(name)}
    given.update((name, getattr(stopping, name)) for name in OPTIONAL_STOPPING if stopping.HasField(name))
    given.update((name, getattr(request, name)) for name in OPTIONAL_REQUEST if request.HasField(name))
    return SamplingParams(top_k=s.top_k, min_p=s.min_p, max_tokens=budget, stop=list(stopping.stop),
                          stop_token_ids=stopping.stop_token_ids, logit_bias=dict(s.logit_bias), grammar=grammar,
                          **given)


def prepare(request: pb.GenerateRequest, limits: ModelLimits, tokenizer: ModelTokenizer | None) -> PreparedRequest:
    """Validate and translate ``request``; raise InvalidRequest naming the first bad GenerateRequest field."""
    try:
        token_ids = truncated(prompt_token_ids(request, tokenizer), request)
        check_prompt(token_ids, limits)
        if request.stopping.stop and tokenizer is None:
            raise InvalidRequest("stop", "stop strings need a tokenizer and this executor has none")
        requested = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else None
        grammar = compile_grammar(request.structured_output, tokenizer, limits.vocab_size)
        params = sampling_params(request, completion_budget(requested, len(token_ids), limits), grammar)
        check_token_ids(params, limits)
        resumed = list(request.resume.completion_token_ids)
        check_resume(resumed, params, limits)
        check_fits_cache(len(token_ids), params, limits)
        interval = stream_interval(request)
    except InvalidRequest as e:
        raise public_error(e) from e
    return PreparedRequest(request.request_id or uuid.uuid4().hex, token_ids, params, resumed, interval)


def sampling_to_proto(p: SamplingParams) -> executor_pb2.SamplingParams:
    """What the executor's sampler needs; fields at their default are left unset (a smaller plan)."""
    msg = executor_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                      logit_bias=p.logit_bias, min_tokens=p.min_tokens)
    if p.min_tokens:
        msg.stop_token_ids.extend(sorted(p.stop_token_ids))
        msg.ignore_eos = p.ignore_eos
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if value != DEFAULTS[name]:
            setattr(msg, name, value)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.num_logprobs = p.logprobs
    if p.grammar is not None:
        msg.grammar = p.grammar
    if p.prompt_logprobs is not None:
        msg.num_prompt_logprobs = p.prompt_logprobs
    return msg


def plan_to_proto(plan: Plan) -> executor_pb2.StepPlan:
    """The StepPlan message of ``plan``; columns go in with one extend each (this runs every step)."""
    msg = executor_pb2.StepPlan(step_id=plan.step_id, is_prefill=plan.is_prefill,
                                finished_request_ids=plan.finished_request_ids,
                                after_whole_step_id=plan.after_whole_step_id)
    for new in plan.new_requests:
        msg.new_requests.add(request_id=new.request_id, token_ids=new.token_ids, sampling=sampling_to_proto(new.params),
                             block_table=new.block_table, num_computed_tokens=new.num_computed_tokens,
                             num_scheduled_tokens=new.num_scheduled_tokens, num_prompt_tokens=new.num_prompt_tokens)
    c = plan.cached
    if c.request_ids:
        cached = msg.cached_requests
        cached.request_ids.extend(c.request_ids)
        cached.num_computed_tokens.extend(c.num_computed_tokens)
        cached.num_scheduled_tokens.extend(c.num_scheduled_tokens)
        cached.num_new_blocks.extend(c.num_new_blocks)
        cached.new_block_ids.extend(c.new_block_ids)
        cached.num_decode_steps.extend(c.num_decode_steps)
    return msg


def token_logprobs(lp: executor_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))


def logprobs_from_result(result: executor_pb2.StepResult) -> list[TokenLogprobs]:
    """A step's logprobs, parallel to its token ids; empty when no request asked."""
    return [token_logprobs(lp) for lp in result.logprobs]


def prompt_logprobs_from_result(result: executor_pb2.StepResult) -> dict[int, tuple[int, list[TokenLogprobs]]]:
    """Request id -> (position of the first prompt token scored, the logprobs of that run of prompt tokens)."""
    return {p.request_id: (p.first_position, [token_logprobs(lp) for lp in p.logprobs])
            for p in result.prompt_logprobs}


def token_logprob(token_id: int, lp: TokenLogprobs) -> pb.TokenLogprob:
    top = [pb.Logprob(token_id=t, logprob=p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
    return pb.TokenLogprob(token_id=token_id, logprob=lp.logprob, top=top)


def to_response(request_id: str, outputs: list[RequestOutput]) -> pb.GenerateResponse:
    """Several loop outputs of one choice of a request as one response (the last one decides the finish)."""
    first = outputs[0]
    if len(outputs) == 1:  # a decode step's token, most of what streams: one constructor call (W5 api)
        response = pb.GenerateResponse(request_id=request_id, index=first.index, text=first.text,
                                       token_ids=first.token_ids)
    else:
        response = pb.GenerateResponse(request_id=request_id, index=first.index,
                                       text="".join(output.text for output in outputs),
                                       token_ids=[t for output in outputs for t in output.token_ids])
    if first.prompt_logprobs is not None:
        token_ids, logprobs = first.prompt_logprobs
        response.prompt_logprobs.extend(token_logprob(t, lp) for t, lp in zip(token_ids, logprobs, strict=True))
    for output in outputs:
        if output.logprobs:
            response.logprobs.extend(token_logprob(t, lp) for t, lp in zip(output.token_ids, output.logprobs,
                                                                            strict=False))
    last = outputs[-1]
    if last.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[last.finish_reason]
        u = last.usage
        response.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                         cached_prompt_tokens=u.cached_prompt_tokens))
    return response


def model_info(info: executor_pb2.ExecutorInfo, tokenizer: ModelTokenizer | None) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=info.model_id,
        architecture=info.architecture,
        dtype=info.dtype,
        device=info.device,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids,
        has_chat_template=tokenizer is not None and tokenizer.has_chat_template,
        has_tokenizer=tokenizer is not None,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        executor_instance_id=info.instance_id,
    )


def scheduler_stats(stats: LoopStats) -> pb.SchedulerStats:
    """The stats GetStats has fields for; the others are for the metrics only."""
    return pb.SchedulerStats(**{name: getattr(stats, name) for name in pb.SchedulerStats.DESCRIPTOR.fields_by_name})
