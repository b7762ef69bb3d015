"""A Responses API request as the chat completion request it amounts to, as vLLM reads it: ``instructions`` a
system message, the conversation a stored response continues (``previous_response_id``), then the input items as
chat messages (a function call joins the assistant message before it, its output is a tool message), the tools and
``text.format`` in chat's shapes. The chat route's code then renders, checks and reads it; what it refuses is named
back as the Responses API names it (``renamed``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.responses_api.schemas import (
    LOGPROBS,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    ResponsesRequest,
)
from scheduler_svc.api.http.translate import UNSUPPORTED_EXTRAS

# Chat's parameters as the Responses API names them.
RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "response_format": "text"}
# Settings a chat completion request takes under the same name.
SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
          "include_stop_str_in_output", "priority", "cache_salt", "chat_template_kwargs", "include_reasoning",
          "parallel_tool_calls", "structured_outputs")
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")


def renamed(error: ApiError) -> ApiError:
    """A chat refusal, its parameter named as the Responses API names it (a chat message's place is no input item's:
    ``messages[2].content`` is ``input``)."""
    old = error.detail.param
    new = RESPONSES_NAMES.get(old or "")
    if old is None or new is None:
        return error
    message = str(error)
    if message.startswith(old):
        message = new + (":" + message.split(":", 1)[1] if ":" in message else message[len(old):])
    return ApiError(error.status, message, new, error.detail.code)


def refuse(where: str, what: str) -> ApiError:
    return ApiError(400, f"{where}: {what}", where.split("[", 1)[0].split(".", 1)[0])


def text_of(content: Any, where: str) -> str:
    """A message's or an output's content: a string, or text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(where, "give a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS and kind != "refusal":
            raise refuse(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise refuse(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise refuse(f"{where}.{name}", "must be a string")
    return value


def last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def add_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    """A function call joins the assistant message before it (one turn's calls are one message), else starts one."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if (previous := last_assistant(messages)) is not None:
        previous.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """One input item as chat messages, in vLLM's way of joining them."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise refuse(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        text = text_of(item.get("content"), f"{where}.content")
        previous = last_assistant(messages) if role == "assistant" else None
        if previous is not None and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": role, "content": text})
    elif kind == "function_call":
        add_call(messages, field(item, "call_id", where), field(item, "name", where), field(item, "arguments", where))
    elif kind == "function_call_output":
        output = text_of(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": field(item, "call_id", where), "content": output})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise refuse(f"{where}.encrypted_content", "encrypted reasoning is not supported")
        parts = item.get("content") or item.get("summary") or []
        text = text_of([{"type": "text", "text": p.get("text") if isinstance(p, dict) else None} for p in parts]
                       if isinstance(parts, list) else parts, f"{where}.content")
        previous = last_assistant(messages)
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = text
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": text})
    else:
        raise refuse(f"{where}.type", f"input items of type {kind!r} are not supported (message, function_call, "
                                      "function_call_output, reasoning are)")


def continues_last(items: str | list[dict[str, Any]]) -> bool:
    """vLLM's partial message: a last assistant message (or reasoning) still in progress is continued, not answered."""
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress", "incomplete") and (last.get("type") == "reasoning" or last.get("role") == "assistant")


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A stored response's answer as the assistant's turn of the next request (its thinking left out, as vLLM)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, MessageItem):
            messages.append({"role": "assistant", "content": "".join(part.text for part in item.content)})
        elif isinstance(item, FunctionCallItem):
            add_call(messages, item.call_id, item.name, item.arguments)
    return messages


@dataclass
class Conversation:
    """What a request sends: its conversation (kept for a later ``previous_response_id``: the instructions are not),
    and the chat request."""

    messages: list[dict[str, Any]]
    chat: schemas.ChatCompletionRequest


def tool_choice(body: ResponsesRequest, auto_parser: str) -> str | dict[str, Any]:
    """Chat's form of the request's tool choice. Without tools "auto" is "none"; with tools but no parser to read
    calls out of an answer, "auto" answers in text, as vLLM's Responses API does (its chat route refuses it)."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise refuse("tool_choice", 'give "none", "auto", "required" or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice == "auto" and (not body.tools or not auto_parser):
        return "none"
    return choice


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.schema_ is None:
        raise refuse("text.format.schema", "type json_schema needs a schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "description": fmt.description, "strict": fmt.strict}}


def conversation(body: ResponsesRequest, history: list[dict[str, Any]] | None, auto_parser: str,
                 stream: bool) -> Conversation:
    """``history``: the messages of the stored response this one continues, its answer included."""
    if body.prompt is not None:
        raise refuse("prompt", "prompt templates are not supported")
    fmt = body.text.format if body.text is not None else None
    if body.structured_outputs is not None and fmt is not None and fmt.type != "text":
        raise refuse("structured_outputs", "give either text.format or structured_outputs, not both")
    # A stored conversation is copied: an item joining its last message must not change what is kept.
    messages: list[dict[str, Any]] = copy.deepcopy(history or [])
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            add_item(messages, item, f"input[{i}]")
    continued = continues_last(body.input)
    logprobs = LOGPROBS in (body.include or ())
    settings = {name: getattr(body, name) for name in SHARED}
    extras = {name: value for name, value in (body.model_extra or {}).items() if name in UNSUPPORTED_EXTRAS}
    if (body.model_extra or {}).get("use_beam_search"):  # chat's, not the Responses API's (as on vLLM)
        raise refuse("use_beam_search", "beam search is not supported by the Responses API")
    chat = {**extras, **settings, "stream": stream,
            "max_completion_tokens": body.max_output_tokens,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
            "logprobs": logprobs, "top_logprobs": body.top_logprobs if logprobs else None,
            "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                      for tool in body.tools] or None,
            "tool_choice": tool_choice(body, auto_parser), "response_format": response_format(body),
            "truncate_prompt_tokens": -1 if body.truncation == "auto" else None,
            "add_generation_prompt": not continued, "continue_final_message": continued}
    chat["messages"] = [{"role": "system", "content": body.instructions}, *messages] if body.instructions else messages
    try:
        return Conversation(messages, schemas.ChatCompletionRequest.model_validate(chat))
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else "input"
        raise refuse(RESPONSES_NAMES.get(param, param), first["msg"]) from e
