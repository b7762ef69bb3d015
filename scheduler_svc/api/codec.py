"""Public responses out: the engine loop's outputs, the model and the stats as the gRPC API's messages."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from common.step import ExecutorInfo, LoraAdapterInfo, TokenLogprobs
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.engine.stats import LoopStats

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.REPETITION: pb.FINISH_REASON_REPETITION,
}


def token_logprob(token_id: int, lp: TokenLogprobs) -> pb.TokenLogprob:
    top = [pb.Logprob(token_id=t, logprob=p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
    return pb.TokenLogprob(token_id=token_id, logprob=lp.logprob, top=top, rank=lp.rank)


def to_response(request_id: str, outputs: list[RequestOutput], prompt_token_ids: list[int] | None = None
                ) -> pb.GenerateResponse:
    """Several loop outputs of one choice of a request as one response (the last one decides the finish);
    ``prompt_token_ids`` where the response is a stream's first and the request asked for them."""
    first = outputs[0]
    if len(outputs) == 1:  # a decode step's token, most of what streams: one constructor call (W5 api)
        response = pb.GenerateResponse(request_id=request_id, index=first.index, text=first.text,
                                       token_ids=first.token_ids)
    else:
        response = pb.GenerateResponse(request_id=request_id, index=first.index,
                                       text="".join(output.text for output in outputs),
                                       token_ids=[t for output in outputs for t in output.token_ids])
    if prompt_token_ids is not None:
        response.prompt_token_ids.extend(prompt_token_ids)
    if first.prompt_logprobs is not None:
        token_ids, logprobs = first.prompt_logprobs
        response.prompt_logprobs.extend(token_logprob(t, lp) for t, lp in zip(token_ids[1:], logprobs, strict=True))
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
        stop = last.matched_stop if last.finish_reason is FinishReason.STOP else None  # REPETITION: its reason says
        if isinstance(stop, str):
            response.stop_string = stop
        elif stop is not None:
            response.stop_token_id = stop
    return response


def responses(request_id: str, outputs: list[RequestOutput], one_choice: bool,
              prompt_token_ids: list[int] | None = None) -> Iterator[pb.GenerateResponse]:
    """A batch of a stream's outputs as its responses: one per run of outputs of the same choice;
    ``prompt_token_ids`` on the first (the stream's first batch, where the request asked for them)."""
    if one_choice:
        yield to_response(request_id, outputs, prompt_token_ids)
        return
    for _, run in itertools.groupby(outputs, key=lambda output: output.index):
        yield to_response(request_id, list(run), prompt_token_ids)
        prompt_token_ids = None


def model_info(info: ExecutorInfo, tokenizer: ModelTokenizer | None,
               adapters: Iterable[LoraAdapterInfo] = ()) -> pb.ModelInfo:
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
        lora_adapters=map(lora_card, adapters),
    )


def lora_card(adapter: LoraAdapterInfo) -> pb.LoraAdapterCard:
    return pb.LoraAdapterCard(name=adapter.name, path=adapter.path, rank=adapter.rank)


def scheduler_stats(stats: LoopStats) -> pb.SchedulerStats:
    """The stats GetStats has fields for; the others are for the metrics only."""
    return pb.SchedulerStats(**{name: getattr(stats, name) for name in pb.SchedulerStats.DESCRIPTOR.fields_by_name})
