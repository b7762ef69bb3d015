"""A generate request as the one GenerateRequest it becomes, checked as the completion routes check theirs."""

from __future__ import annotations

import uuid

from scheduler_svc.api.http import schemas, translate
from scheduler_svc.api.http.answering import raise_stream_interval
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.generate_api.schemas import (
    SAMPLING_UNSUPPORTED,
    UNSUPPORTED,
    GenerateRequest,
    SamplingParams,
    set_extras,
)

# The answer's id: vLLM's prefix before the caller's id.
ID_PREFIX = "generate-tokens-"
# SamplingParams' fields that the completion routes' parameters share, name for name.
SHARED = frozenset(SamplingParams.model_fields) & frozenset(schemas.GenerationParameters.model_fields)


def refuse_unsupported(body: GenerateRequest) -> None:
    for where, names in (("", UNSUPPORTED), ("sampling_params.", SAMPLING_UNSUPPORTED)):
        for name, what in set_extras(body if not where else body.sampling_params, names):
            raise ApiError(400, f"{where}{name}: {what} is not supported by this server", where.rstrip(".") or name)
    params = body.sampling_params
    if (params.model_extra or {}).get("structured_output") and params.structured_outputs is None:
        raise ApiError(400, "sampling_params.structured_outputs: a render's structured_output true needs the "
                            "constraint itself: send structured_outputs", "sampling_params")
    if body.output_mode == "text" and not params.detokenize:
        raise ApiError(400, "sampling_params.detokenize: output_mode text needs detokenize true", "sampling_params")
    if body.output_mode == "text" and not params.spaces_between_special_tokens:
        raise ApiError(400, "sampling_params.spaces_between_special_tokens: false is not supported by this server",
                       "sampling_params")
    if params.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "sampling_params.prompt_logprobs: not available when stream is true", "sampling_params")


def generate_request(body: GenerateRequest, served: translate.Served, request_id: str | None,
                     stream_interval: int) -> translate.Translated:
    """``request_id``: the X-Request-Id header's, which takes the place of the body's; ``stream_interval``: the
    server's, which a request may raise but not lower (vLLM's rule); ``stream_options`` without ``stream`` are
    ignored, as vLLM's generate route ignores them."""
    lora = translate.check_model(body.model, served)
    refuse_unsupported(body)
    params = body.sampling_params
    shared = schemas.GenerationParameters(**params.model_dump(include=SHARED, by_alias=True))
    renames: dict[str, str] = {}
    try:
        request = translate.base_request(shared, params.max_tokens, params.logprobs, renames)
    except ApiError as e:  # named as the completion routes name it: here it is inside sampling_params
        raise ApiError(e.status, f"sampling_params.{e}", "sampling_params") from e
    renames.update({name: f"sampling_params.{name}" for name in SamplingParams.model_fields},
                   prompt="token_ids", structured_output="sampling_params.structured_outputs")
    request.tokens.token_ids.extend(body.token_ids)
    request.lora, request.priority, request.cache_salt = lora, body.priority, body.cache_salt or ""
    if params.max_tokens is None:
        request.stopping.max_tokens_to_room = True
    request.return_prompt_token_ids = bool(body.return_token_ids)
    if body.reasoning_ended and request.HasField("structured_output"):
        request.structured_output.from_first_token = True
    request.request_id = ID_PREFIX + (request_id or body.request_id or uuid.uuid4().hex)
    options = body.stream_options if body.stream else None
    t = translate.Translated(
        request.request_id, lora or served.model_id, [request], renames, params.n, bool(body.stream),
        bool(options and options.include_usage), params.logprobs, True, [],
        bool(options and options.include_usage and options.continuous_usage_stats))
    raise_stream_interval(t, params.stream_interval, stream_interval)
    return t


def with_prefix(request_ids: str | list[str]) -> list[str]:
    """Each id as given and as the answer spelled it (``generate-tokens-<id>``)."""
    ids = [request_ids] if isinstance(request_ids, str) else request_ids
    return [*ids, *(ID_PREFIX + i for i in ids if not i.startswith(ID_PREFIX))]
