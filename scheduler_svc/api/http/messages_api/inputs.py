"""An Anthropic Messages request as the chat completion request it amounts to, as vLLM converts it: ``system`` a
system message first (Claude Code's per-request billing header left out, so that the prefix cache holds), each
message's text blocks its content, ``thinking`` blocks its reasoning, ``tool_use`` blocks its tool calls, and a
user's ``tool_result`` blocks tool messages before it; ``tools``, ``tool_choice`` (``any`` is ``"required"``),
``thinking`` (``disabled`` turns the template's thinking off; ``enabled`` with ``budget_tokens`` is the thinking
budget where the scheduler reads the thinking, ``--reasoning-parser``) and ``output_config`` in chat's shapes.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.chat_output import new_tool_call_id
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.messages_api.schemas import CountTokensRequest, MessagesRequest

BILLING_HEADER = "x-anthropic-billing-header"
# Chat's parameters as the Messages API names them.
MESSAGES_NAMES = {"max_completion_tokens": "max_tokens", "response_format": "output_config", "stop": "stop_sequences",
                  "thinking_token_budget": "thinking"}


def renamed(error: ApiError) -> ApiError:
    """A chat refusal, its parameter named as the Messages API names it."""
    old = error.detail.param
    new = MESSAGES_NAMES.get(old or "")
    if old is None or new is None:
        return error
    message = str(error)
    return ApiError(error.status, new + message[len(old):] if message.startswith(old) else message, new)


def refuse(where: str, what: str) -> ApiError:
    return ApiError(400, f"{where}: {what}", where.split("[", 1)[0].split(".", 1)[0])


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise refuse(where, "must be a string")
    return value


def blocks(content: list[Any], where: str) -> list[tuple[str, dict[str, Any]]]:
    """Each block with its place, refused where it is not an object."""
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise refuse(f"{where}[{j}]", "a content block is an object")
    return [(f"{where}[{j}]", block) for j, block in enumerate(content)]


def system_text(system: str | list[Any] | None, where: str) -> str:
    """A system prompt's text: a string, or its text blocks joined (a block with the billing header left out)."""
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for at, block in blocks(system, where):
        if block.get("type") != "text":
            raise refuse(f"{at}.type", f"a system prompt takes text blocks, got {block.get('type')!r}")
        part = block.get("text")
        if part and not text(part, f"{at}.text").startswith(BILLING_HEADER):
            parts.append(part)
    return "".join(parts)


def tool_result(content: Any, where: str) -> str:
    """A tool result's text: a string, or its text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise refuse(where, "give a string or a list of text blocks")
    parts = []
    for at, block in blocks(content, where):
        if block.get("type") != "text":
            raise refuse(at, f"only text blocks are supported in a tool result, got {block.get('type')!r}")
        parts.append(text(block.get("text"), f"{at}.text"))
    return "\n".join(parts)


def add_message(messages: list[dict[str, Any]], role: str, content: str | list[Any], where: str) -> None:
    """One message as chat messages: a user's tool results first, as tool messages, then the rest of it. As vLLM
    reads them, empty text and thinking are skipped, a tool use without an id gets one, a result without one has
    none."""
    if role == "system":
        if body := system_text(content, f"{where}.content"):
            messages.append({"role": "system", "content": body})
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for at, block in blocks(content, f"{where}.content"):
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                texts.append(text(block["text"], f"{at}.text"))
        elif kind == "thinking":
            if block.get("thinking") is not None:
                thinking.append(text(block["thinking"], f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque: a client sends it back as it got it
        elif kind == "tool_use":
            arguments = block.get("input") or {}
            if not isinstance(arguments, dict):
                raise refuse(f"{at}.input", "must be an object")
            calls.append({"id": text(block.get("id") or new_tool_call_id(), f"{at}.id"), "type": "function",
                          "function": {"name": text(block.get("name"), f"{at}.name"),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            messages.append({"role": "tool", "tool_call_id": text(block.get("tool_use_id") or "", f"{at}.tool_use_id"),
                             "content": tool_result(block.get("content"), f"{at}.content")})
        elif kind == "tool_result":  # an assistant's, as vLLM reads it
            texts.append(f"Tool result: {tool_result(block.get('content'), f'{at}.content')}")
        else:
            raise refuse(f"{at}.type", f"content blocks of type {kind!r} are not supported (text, thinking, "
                                       "redacted_thinking, tool_use, tool_result are)")
    message: dict[str, Any] = {"role": role}
    if texts:
        message["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning"] = "".join(thinking)
    if role != "user" or "content" in message:
        messages.append(message)


def tool_choice(choice: Any, has_tools: bool) -> dict[str, Any]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` for the request's (unset with tools: ``"auto"``)."""
    if choice is None:
        return {"tool_choice": "auto"} if has_tools else {}
    out: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise refuse("tool_choice.name", 'type "tool" needs the name of the tool to call')
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return out


def chat_request(body: CountTokensRequest, stream: bool = False, thinks: bool = False) -> schemas.ChatCompletionRequest:
    """``thinks``: the scheduler reads the thinking (``--reasoning-parser``, over a vocabulary with its markers), so
    ``thinking.budget_tokens`` bounds it (vLLM's thinking_token_budget); without, it bounds nothing, as a model that
    does not think needs no bound."""
    messages: list[dict[str, Any]] = []
    if system := system_text(body.system, "system"):
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        add_message(messages, message.role, message.content, f"messages[{i}]")
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "chat_template_kwargs": body.chat_template_kwargs, **tool_choice(body.tool_choice,
                                                                                             bool(body.tools))}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                            "parameters": tool.input_schema, "strict": tool.strict,
                                                            "defer_loading": tool.defer_loading}}
                         for tool in body.tools]
    config = body.output_config
    if config is not None and config.format is not None and config.format.schema_ is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "json_schema", "schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = config.effort
    if body.thinking is not None and body.thinking.type == "disabled":
        chat["reasoning_effort"] = "none"  # the template's enable_thinking off
    if isinstance(body, MessagesRequest):
        budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
        if budget is not None and budget >= body.max_tokens:
            raise refuse("thinking.budget_tokens", "must be less than max_tokens")
        if budget is not None and thinks:
            chat["thinking_token_budget"] = budget
        chat.update(max_completion_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, stream=stream, cache_salt=body.cache_salt)
    try:
        return schemas.ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else "messages"
        raise refuse(MESSAGES_NAMES.get(param, param), first["msg"]) from e
