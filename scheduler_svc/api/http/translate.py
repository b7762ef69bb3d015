"""OpenAI requests in, as the GenerateRequests the gRPC API receives; refused fields named back as OpenAI spells them.

Nothing here checks a range: the scheduler does that once for both APIs (``api.prepare.prepare``), and
``openai_param`` renames the GenerateRequest field it names (``sampling.temperature`` -> ``temperature``).
What is refused here is what OpenAI's parameters can say and GenerateRequest cannot, so that no
parameter is silently dropped when dropping it would change the output.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import NamedTuple

from common.sampling import TO_MODEL_LENGTH
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.http import beam_request, chat_render, schemas, tool_request
from scheduler_svc.api.http.chat_output import NO_PARSING, ChatOutput, ChatParsing
from scheduler_svc.api.http.errors import ApiError, failure
from scheduler_svc.api.http.tool_parsers import TOOL_PARSERS
from scheduler_svc.api.http.translated import Translated, shown_logprobs
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.errors import InvalidRequest, RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer

# max_tokens of a /v1/completions request that leaves it out: OpenAI's and vLLM's.
COMPLETION_MAX_TOKENS = 16
# OpenAI's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}


def openai_param(field: str, renames: Mapping[str, str]) -> str:
    """The OpenAI parameter (with its path, e.g. ``messages[1].role``) behind a GenerateRequest field."""
    name = field.removeprefix("sampling.").removeprefix("stopping.")
    if name.startswith("chat.messages"):
        return "messages" + name.removeprefix("chat.messages")
    if name == "chat":
        return "messages"
    if name == "chat.template_kwargs":
        return "chat_template_kwargs"
    if name == "chat.continue_final_message":
        return "continue_final_message"
    if name in ("text", "tokens.token_ids"):
        name = "prompt"
    if name.startswith("structured_output"):
        name = "structured_output"
    return renames.get(name, name)


def api_error(error: RequestFailed, renames: Mapping[str, str]) -> ApiError:
    """A scheduler refusal as an answer, naming the OpenAI parameter behind a refused field."""
    return failure(error, openai_param(error.field, renames) if isinstance(error, InvalidRequest) else None)


class Served(NamedTuple):
    """What a request's ``model`` may name: the base model by any of its names, or a LoRA adapter by its name (as
    vLLM serves them)."""

    # The base model's name that answers report (--served-model-name's first, else the executor's model id).
    model_id: str
    adapters: frozenset[str] = frozenset()
    # --served-model-name's other names, which name the base model too.
    aliases: tuple[str, ...] = ()
    # The model's tokenizer, which renders a conversation with tools (``chat_render``).
    tokenizer: ModelTokenizer | None = None

    @classmethod
    def of(cls, names: tuple[str, ...], adapters: frozenset[str], tokenizer: ModelTokenizer | None = None) -> Served:
        return cls(names[0], adapters, names[1:], tokenizer)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_id, *self.aliases)


def check_model(requested: str | None, served: Served) -> str:
    """The LoRA adapter ``requested`` names ("" for the base model); 404 when it names nothing served."""
    if requested is None or requested in served.names:
        return ""
    if requested in served.adapters:
        return requested
    names = ", ".join(f"`{name}`" for name in served.names)
    adapters = f" and the LoRA adapters {', '.join(sorted(served.adapters))}" if served.adapters else ""
    raise ApiError(404, f"The model `{requested}` does not exist; this server serves {names}{adapters}",
                   "model", "model_not_found")


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param)


def is_set(value: object) -> bool:
    return value is not None


# vLLM's extra parameters that change the answer and that this server does not take: refused when given anything
# but their default, so that none is silently dropped (any other unknown parameter is ignored, as OpenAI does).
UNSUPPORTED_EXTRAS: dict[str, tuple[Callable[[object], bool], str]] = {
    "kv_transfer_params": (is_set, "KV cache transfer between instances"),
    **{f"guided_{kind}": (is_set, f"guided_{kind}, vLLM's older name (send structured_outputs.{kind})")
       for kind in ("json", "regex", "choice", "grammar")},
}


def refuse_unsupported_extras(body: schemas.Request) -> None:
    for name, value in (body.model_extra or {}).items():
        rule = UNSUPPORTED_EXTRAS.get(name)
        if rule is not None and rule[0](value):
            raise unsupported(name, rule[1])


def logit_bias(bias: Mapping[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as string keys."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < 2**32:
            raise ApiError(400, f"logit_bias: the key {key!r} is not a token id", "logit_bias")
        out[token_id] = value
    return out


def structured_output(body: schemas.GenerationParameters,
                      forced: dict | None = None) -> tuple[pb.StructuredOutput | None, str]:
    """The one constraint of ``response_format`` or vLLM's ``structured_outputs``, and which of the two set it; a
    forced tool choice's schema (``forced``) replaces both, as on vLLM."""
    if forced is not None:
        return pb.StructuredOutput(json_schema=json.dumps(forced)), "tools"
    fmt, outputs = body.response_format, body.structured_outputs
    from_format = fmt is not None and fmt.type != "text"
    if from_format and outputs is not None:
        raise ApiError(400, "structured_outputs: give either response_format or structured_outputs, not both",
                       "structured_outputs")
    if from_format:
        if fmt.type == "json_object":
            return pb.StructuredOutput(json_object=True), "response_format"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format: type json_schema needs json_schema.schema", "response_format")
        return pb.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_)), "response_format"
    if outputs is None:
        return None, "response_format"
    given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                             ("choice", outputs.choice), ("grammar", outputs.grammar),
                                             ("json_object", outputs.json_object)) if value is not None}
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                            f"(got {', '.join(given) or 'none'})", "structured_outputs")
    (name, value), = given.items()
    if name == "json":
        constraint = pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    elif name == "choice":
        constraint = pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    else:
        constraint = pb.StructuredOutput(**{name: value})
    return constraint, "structured_outputs"


def base_request(body: schemas.GenerationParameters, max_tokens: int | None, logprobs: int | None,
                 renames: dict[str, str], forced: dict | None = None) -> pb.GenerateRequest:
    """The settings every prompt of the request shares; records where the structured output came from. As vLLM reads
    them, top_k -1 is no top-k (not the model's default) and seed -1 no seed (a random one each time)."""
    sampling = pb.SamplingOptions(
        temperature=body.temperature, top_k=0 if body.top_k == -1 else body.top_k, top_p=body.top_p,
        min_p=body.min_p, seed=None if body.seed in (None, -1) else body.seed % 2**64,
        logprobs=None if body.logprob_token_ids else logprobs, logprob_token_ids=body.logprob_token_ids or (),
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=logit_bias(body.logit_bias), n=body.n,
        thinking_token_budget=None if body.thinking_token_budget == -1 else body.thinking_token_budget)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    stopping = pb.StoppingOptions(max_tokens=max_tokens, stop=stop, stop_token_ids=body.stop_token_ids or [],
                                  ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
    if body.repetition_detection is not None:
        stopping.repetition_detection.CopyFrom(pb.RepetitionDetection(**body.repetition_detection.model_dump()))
    if body.allowed_token_ids is not None:  # an empty list is sent, to be refused as vLLM refuses it
        sampling.allowed_token_ids.SetInParent()
        sampling.allowed_token_ids.token_ids.extend(body.allowed_token_ids)
    sampling.bad_words.extend(body.bad_words or ())
    if body.prompt_logprobs and body.stream:
        raise ApiError(400, "prompt_logprobs: not available when stream is true", "prompt_logprobs")
    truncate = body.truncate_prompt_tokens
    request = pb.GenerateRequest(sampling=sampling, stopping=stopping, skip_special_tokens=body.skip_special_tokens,
                                 truncate_prompt_tokens=TO_MODEL_LENGTH if truncate == -1 else truncate,  # vLLM's -1
                                 prompt_logprobs=body.prompt_logprobs, priority=body.priority or 0,
                                 return_prompt_token_ids=bool(body.return_token_ids), cache_salt=body.cache_salt,
                                 truncation_side=pb.TRUNCATION_SIDE_RIGHT if body.truncation_side == "right" else None)
    constraint, renames["structured_output"] = structured_output(body, forced)
    if constraint is not None:
        request.structured_output.CopyFrom(constraint)
    return request


def translated(body: schemas.GenerationParameters, prefix: str, model: str, requests: list[pb.GenerateRequest],
               renames: dict[str, str], top_logprobs: int | None, echo: list[str],
               echo_only: bool = False) -> Translated:
    """Name the requests after the response (``<id>`` or ``<id>-<i>``), so the gRPC Abort can end them."""
    response_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
    for i, request in enumerate(requests):
        request.request_id = response_id if len(requests) == 1 else f"{response_id}-{i}"
    options = body.stream_options
    if options is not None and not body.stream:
        raise ApiError(400, "stream_options: only with stream set to true", "stream_options")
    return Translated(response_id, model, requests, renames, body.n or 1, bool(body.stream),
                      bool(options and options.include_usage), top_logprobs, bool(body.return_token_ids), echo,
                      bool(options and options.include_usage and options.continuous_usage_stats), echo_only)


def message_text(message: schemas.Message, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                           "messages")
    return "\n".join(part.text for part in message.content)


def chat_prompt(messages: list[schemas.Message], add_generation_prompt: bool | None,
                template_kwargs: dict[str, object] | None, continue_final: bool = False) -> pb.ChatPrompt:
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role=ROLE_ALIASES.get(m.role, m.role), content=message_text(m, i))
                                   for i, m in enumerate(messages)], add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final)
    if template_kwargs:
        chat.template_kwargs.update(template_kwargs)
    return chat


def tool_choice(body: schemas.ChatCompletionRequest, parsing: ChatParsing) -> tool_request.ToolChoice:
    """The request's tool choice, refused as vLLM refuses it (and ``functions``, OpenAI's older form, here)."""
    if body.functions:
        raise unsupported("functions", "function calling, OpenAI's older form (send tools)")
    choice = tool_request.tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls)
    if choice.kind == "auto" and not parsing.auto_tool_parser:
        raise ApiError(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", "tool_choice")
    outputs = body.structured_outputs
    if choice.kind == "named" and outputs is not None and any(
            value is not None for value in (outputs.json_, outputs.regex, outputs.choice)):
        raise ApiError(400, "structured_outputs: You can only either use constraints for structured outputs or "
                            "tools, not both.", "structured_outputs")
    return choice


def template_kwargs(body: schemas.ChatCompletionRequest, defaults: Mapping[str, object] | None = None
                    ) -> dict[str, object] | None:
    """The request's chat_template_kwargs, with its reasoning_effort as vLLM adds it: as a variable, and as
    ``enable_thinking`` (off for "none") unless the request sets that itself; vLLM's ``documents`` (RAG) as the
    template's ``documents``, over chat_template_kwargs' own (vLLM's order); all over ``defaults`` (the server's
    --default-chat-template-kwargs)."""
    own = dict(body.chat_template_kwargs or {})
    if (effort := body.reasoning_effort) is not None:  # the request's: over the server's defaults, as vLLM's
        own = {"enable_thinking": effort != "none", **own, "reasoning_effort": effort}
    return {**(defaults or {}), **own, **({"documents": body.documents} if body.documents is not None else {})} or None


def chat_request(body: schemas.ChatCompletionRequest, served: Served, parsing: ChatParsing = NO_PARSING
                 ) -> Translated:
    """``parsing``: the scheduler's flags that read chat answers."""
    lora = check_model(body.model, served)
    refuse_unsupported_extras(body)
    choice = tool_choice(body, parsing)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
    top_logprobs = shown_logprobs(body, (body.top_logprobs or 0) if body.logprobs else None, "logprobs set to true")
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    renames = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_param}
    request = base_request(body, getattr(body, max_param), top_logprobs, renames, tool_request.forced_schema(choice))
    # Unset, as vLLM's chat completions: as long as the room the conversation leaves.
    request.stopping.max_tokens_to_room = True
    parser = TOOL_PARSERS.get(parsing.auto_tool_parser)
    if parser is not None and parser.keeps_special_tokens and choice.tools and choice.kind != "none":
        request.skip_special_tokens = False
    kwargs, continued = template_kwargs(body, parsing.default_chat_template_kwargs), bool(body.continue_final_message)
    if continued and body.add_generation_prompt:  # as vLLM refuses it
        raise ApiError(400, "continue_final_message: not with add_generation_prompt true", "continue_final_message")
    # With thinking to read, the prompt is rendered here: whether it closed the thinking decides how the answer reads.
    markers = ThinkingMarkers.of(served.tokenizer, parsing.reasoning_parser)
    tokenizer = chat_render.with_request_template(served.tokenizer, body.chat_template, parsing.trust_chat_template)
    if chat_render.needs_rendering(body.messages, body.tools) or markers is not None or tokenizer != served.tokenizer:
        request.tokens.token_ids.extend(chat_render.render(
            tokenizer, body.messages, message_text, lambda role: ROLE_ALIASES.get(role, role),
            body.add_generation_prompt, kwargs, [tool.template_dict() for tool in body.tools or ()], continued))
    else:
        request.chat.CopyFrom(chat_prompt(body.messages, body.add_generation_prompt, kwargs, continued))
    request.lora = lora
    last = body.messages[-1] if body.messages else None  # vLLM's echo: the answer goes on from an assistant's message
    echo = [message_text(last, len(body.messages) - 1)] if body.echo and last and last.role == "assistant" else []
    t = translated(body, "chatcmpl", lora or served.model_id, [request], renames, top_logprobs, echo)
    t.beam = beam_request.settings(body, t)
    thinking = bool((kwargs or {}).get("enable_thinking", True))
    constrained = request.HasField("structured_output")
    closed = markers is not None and markers.prompt_ended(request.tokens.token_ids)
    if constrained and markers is not None:  # vLLM's reasoning_ended: no thinking left out or turned off to wait for
        request.structured_output.from_first_token = body.include_reasoning is False or closed or (
            markers.switchable and not thinking)
    waits = constrained and markers is not None and not request.structured_output.from_first_token
    t.chat_output = ChatOutput(choice, parsing.auto_tool_parser, parsing.reasoning_parser, thinking,
                               (constrained and not waits) or closed, body.include_reasoning is not False)
    t.return_prompt_text = bool(body.return_prompt_text)
    t.tokens_as_ids = tokens_as_ids(body, parsing)
    request.return_prompt_token_ids |= t.return_prompt_text  # decoded in the answer
    return t


def tokens_as_ids(body: schemas.GenerationParameters, parsing: ChatParsing) -> bool:
    """vLLM's return_tokens_as_token_ids: the request's, else the server's --return-tokens-as-token-ids."""
    asked = body.return_tokens_as_token_ids
    return parsing.return_tokens_as_token_ids if asked is None else asked


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts: text or token ids each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: the list of prompts is empty", "prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def completion_request(body: schemas.CompletionRequest, served: Served, tokenizer: ModelTokenizer | None,
                       parsing: ChatParsing = NO_PARSING) -> Translated:
    lora = check_model(body.model, served)
    refuse_unsupported_extras(body)
    if body.suffix:
        raise unsupported("suffix", "a suffix (insertion)")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "best_of other than 1")
    renames: dict[str, str] = {}
    requests, echo = [], []
    # vLLM's scoring of a prompt: echo with max_tokens 0 generates one token and answers the prompt alone.
    echo_only = bool(body.echo) and body.max_tokens == 0
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else 1 if echo_only else body.max_tokens
    for prompt in prompts_of(body.prompt):
        request = base_request(body, max_tokens, body.logprobs, renames)
        request.lora = lora
        if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs too
            request.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
            if body.prompt_logprobs is None:
                renames["prompt_logprobs"] = "logprobs"
        if isinstance(prompt, str):
            request.text = prompt
            if body.add_special_tokens is not None:
                request.add_special_tokens = body.add_special_tokens
        else:
            request.tokens.token_ids.extend(prompt)
        requests.append(request)
        if body.echo:
            as_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, False) if tokenizer else ""
            echo.append(as_text)
    if echo_only and body.logprob_token_ids:  # as vLLM refuses it
        raise ApiError(400, "logprob_token_ids: no token is generated with echo and max_tokens 0", "logprob_token_ids")
    top_logprobs = shown_logprobs(body, body.logprobs, "logprobs set")
    t = translated(body, "cmpl", lora or served.model_id, requests, renames, top_logprobs, echo, echo_only)
    t.beam = beam_request.settings(body, t)
    t.tokens_as_ids = tokens_as_ids(body, parsing)
    return t


def tokenize_request(body: schemas.TokenizeRequest, served: Served,
                     defaults: Mapping[str, object] | None = None) -> pb.TokenizeRequest | list[int]:
    """What the scheduler tokenizes, or a conversation's token ids rendered here where a chat completion's are;
    ``defaults``: --default-chat-template-kwargs, under the request's own."""
    check_model(body.model, served)
    kwargs = {**(defaults or {}), **(body.chat_template_kwargs or {})} or None
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give exactly one of prompt or messages", "prompt")
    continued = bool(body.continue_final_message)
    if continued and body.add_generation_prompt:  # as vLLM refuses it
        raise ApiError(400, "continue_final_message: not with add_generation_prompt true", "continue_final_message")
    if body.messages is not None and chat_render.needs_rendering(body.messages, body.tools):
        return chat_render.render(served.tokenizer, body.messages, message_text,
                                  lambda role: ROLE_ALIASES.get(role, role), body.add_generation_prompt,
                                  kwargs, [tool.template_dict() for tool in body.tools or ()], continued)
    request = pb.TokenizeRequest(add_special_tokens=body.add_special_tokens)
    if body.prompt is not None:
        request.text = body.prompt
    else:
        request.chat.CopyFrom(chat_prompt(body.messages, body.add_generation_prompt, kwargs, continued))
    return request


def detokenize_request(body: schemas.DetokenizeRequest, served: Served) -> pb.DetokenizeRequest:
    check_model(body.model, served)
    return pb.DetokenizeRequest(token_ids=body.tokens)
