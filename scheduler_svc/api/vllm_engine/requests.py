"""VllmEngine's GenerateRequest in, as the ``nanoserve.v1`` GenerateRequest the frontend takes, and refusals named back
as VllmEngine spells its fields.

vLLM's SamplingParams message has plain proto3 fields where nanoserve's has ``optional`` ones, so a zero means
"unset" for the fields whose zero is not a value (top_p, repetition_penalty, n) and nanoserve's default applies, as
vLLM's own servicer reads them. What nanoserve cannot do is refused here, naming the field: multimodal inputs,
KV transfer, a structural tag, "all" logprobs (-1), another data-parallel rank.
"""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as vllm

from common.sampling import TO_MODEL_LENGTH
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.errors import InvalidRequest

SAMPLING = "sampling_params"
# The structured-output kinds both protos have, by VllmEngine's oneof name -> nanoserve's StructuredOutput field.
CONSTRAINTS = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": "json_object",
               "choice": "choice"}
# A GenerateRequest field nanoserve names in a refusal -> the VllmEngine field a gateway set.
VLLM_FIELD = {
    "prompt": "input",
    "tokens.token_ids": "tokenized.input_ids",
    "text": "text",
    "prompt_logprobs": f"{SAMPLING}.prompt_logprobs",
    "truncate_prompt_tokens": f"{SAMPLING}.truncate_prompt_tokens",
    "skip_special_tokens": f"{SAMPLING}.skip_special_tokens",
}


def vllm_field(field: str, constraint: str | None = None) -> str:
    """The VllmEngine field behind a nanoserve GenerateRequest field (``sampling.top_p`` -> ``sampling_params.top_p``);
    ``constraint``: the oneof member a structured-output refusal is about."""
    if field in VLLM_FIELD:
        return VLLM_FIELD[field]
    if field.startswith("structured_output") or field == "grammar":
        return f"{SAMPLING}.{constraint or 'constraint'}"
    head, _, name = field.partition(".")
    return f"{SAMPLING}.{name}" if head in ("sampling", "stopping") and name else field


def vllm_error(error: InvalidRequest, constraint: str | None = None) -> InvalidRequest:
    """A nanoserve refusal, naming the VllmEngine field."""
    return InvalidRequest(vllm_field(error.field, constraint), error.reason)


def refuse_unsupported(request: vllm.GenerateRequest) -> None:
    """What a text-only engine without KV transfer cannot take; nothing else is queued when it is refused."""
    for name in ("mm_inputs", "media_refs"):
        if request.HasField(name):
            raise InvalidRequest(name, "multimodal inputs are not supported: nanoserve serves text-only models")
    if request.extra_mm_inputs:
        raise InvalidRequest("extra_mm_inputs", "multimodal inputs are not supported: nanoserve serves text-only "
                                                "models")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params" if request.HasField("kv_transfer_params") else "kv_transfer_params_json"
        raise InvalidRequest(field, "KV transfer (prefill/decode disaggregation) is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequest("data_parallel_rank", f"this engine has one rank, 0; got {request.data_parallel_rank}")


def sampling_options(s: vllm.SamplingParams) -> tuple[pb.SamplingOptions, pb.StoppingOptions]:
    sampling = pb.SamplingOptions()
    if s.HasField("temperature"):
        sampling.temperature = s.temperature
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "n"):
        if value := getattr(s, name):  # zero: unset (nanoserve's default), as vLLM's servicer reads it
            setattr(sampling, name, value)
    if s.HasField("logprobs"):
        if s.logprobs < 0:
            raise InvalidRequest(f"{SAMPLING}.logprobs", "-1 (every token's logprob) is not supported; ask for 0-20")
        sampling.logprobs = s.logprobs
    if s.HasField("seed") and s.seed != -1:  # int32, where gateways clamp a client's seed: a negative one is its
        sampling.seed = s.seed % 2**32  # unsigned twin, but -1 no seed at all, as vLLM's SamplingParams reads it
    for token_id, bias in s.logit_bias.items():
        if token_id < 0:
            raise InvalidRequest(f"{SAMPLING}.logit_bias", f"the key {token_id} is not a token id")
        sampling.logit_bias[token_id] = bias
    stopping = pb.StoppingOptions(stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                                  include_stop_str_in_output=s.include_stop_str_in_output)
    if s.HasField("max_tokens"):
        stopping.max_tokens = s.max_tokens
    if s.min_tokens:
        stopping.min_tokens = s.min_tokens
    return sampling, stopping


def structured_output(s: vllm.SamplingParams) -> pb.StructuredOutput | None:
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    if kind not in CONSTRAINTS:
        raise InvalidRequest(f"{SAMPLING}.{kind}", "a structural tag is not supported; use json_schema, regex, "
                                                   "grammar, json_object or choice")
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=s.choice.choices))
    return pb.StructuredOutput(**{CONSTRAINTS[kind]: getattr(s, kind)})


def cap_to_room(request: pb.GenerateRequest, max_model_len: int) -> None:
    """A token prompt's max_tokens as vLLM's engine takes it: more than the room the prompt leaves is that room (a
    prompt that leaves none is refused where it is checked)."""
    prompt = len(request.tokens.token_ids)
    if request.HasField("truncate_prompt_tokens"):
        keep = request.truncate_prompt_tokens
        prompt = min(prompt, max_model_len - 1 if keep == TO_MODEL_LENGTH else keep)
    room = max_model_len - prompt
    if room >= 1 and request.stopping.max_tokens > room:
        request.stopping.max_tokens = room


def generate_request(request: vllm.GenerateRequest, max_model_len: int) -> pb.GenerateRequest:
    """``request`` as nanoserve's GenerateRequest; InvalidRequest naming the VllmEngine field it cannot take. The
    ranges are checked where the frontend prepares it (rename its refusals with ``vllm_error``)."""
    refuse_unsupported(request)
    s = request.sampling_params
    sampling, stopping = sampling_options(s)
    out = pb.GenerateRequest(sampling=sampling, stopping=stopping, skip_special_tokens=s.skip_special_tokens)
    if request.request_id:
        out.request_id = request.request_id
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        out.tokens.token_ids.extend(request.tokenized.input_ids)
    elif kind == "text":
        out.text = request.text
    else:
        raise InvalidRequest("input", "no prompt set; send tokenized or text")
    if s.HasField("prompt_logprobs"):
        if s.prompt_logprobs < 0:
            raise InvalidRequest(f"{SAMPLING}.prompt_logprobs", "-1 (every token's logprob) is not supported; ask "
                                                                "for 0-20")
        out.prompt_logprobs = s.prompt_logprobs
    if s.HasField("truncate_prompt_tokens"):
        # -1: the model's length less the one token an answer needs (vLLM's meaning).
        truncate = TO_MODEL_LENGTH if s.truncate_prompt_tokens == -1 else s.truncate_prompt_tokens
        if truncate < 1:
            raise InvalidRequest(f"{SAMPLING}.truncate_prompt_tokens", f"must be >= 1 or -1, got {truncate}")
        out.truncate_prompt_tokens = truncate
    if not out.stopping.HasField("max_tokens"):  # the room, bounded by the KV cache and the model's max_new_tokens
        out.stopping.max_tokens_to_room = True
    elif kind == "tokenized":
        cap_to_room(out, max_model_len)
    constraint = structured_output(s)
    if constraint is not None:
        out.structured_output.CopyFrom(constraint)
        # The gateway led the grammar with the thought itself: no waiting for the reasoning parser's end.
        out.structured_output.from_first_token = s.grammar_from_first_token
    return out
