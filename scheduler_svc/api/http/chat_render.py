"""A conversation with tools rendered by the chat template here, into the token ids the request then carries.

A ``GenerateRequest``'s ``ChatPrompt`` holds each message's role and text alone; a template that lists ``tools``,
shows an assistant's earlier ``tool_calls`` or matches a ``tool`` message to its call by ``tool_call_id`` needs the
messages as vLLM hands them to it. So such a conversation is rendered here, with the model's template in the same
environment (``ModelTokenizer``'s), and sent as the prompt's token ids; every other conversation is sent as a
``ChatPrompt``. As vLLM: an assistant's tool call ``arguments`` reach the template as an object (JSON text parsed;
text that is not a JSON object reads as ``{}``), its ``reasoning`` as both ``reasoning`` and ``reasoning_content``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jinja2

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.core.tokenizer import CHAT_ROLES, CONTINUE_TAG, ModelTokenizer, open_final_message


def needs_rendering(messages: list, tools: list | None) -> bool:
    """Whether the conversation holds more than a ``ChatPrompt`` carries."""
    return bool(tools) or any(
        m.tool_calls is not None or m.tool_call_id is not None or m.name is not None or m.reasoning is not None
        or m.reasoning_content is not None for m in messages)


def with_request_template(tokenizer: ModelTokenizer | None, template: str | None,
                          trusted: bool) -> ModelTokenizer | None:
    """The tokenizer rendering with a request's own chat_template (vLLM's), which the server takes only with
    --trust-request-chat-template: a template runs on the server, sandboxed, but as its sender wrote it."""
    if template is None:
        return tokenizer
    if not trusted:
        raise refuse("chat_template", "a chat template sent with the request needs the server's "
                                      "--trust-request-chat-template")
    if tokenizer is None:
        raise refuse("messages", "this executor has no tokenizer; send the prompt as tokens")
    try:
        return tokenizer.with_template(template)
    except jinja2.TemplateError as e:
        raise refuse("chat_template", f"the chat template does not compile: {e.message or type(e).__name__}") from e


def refuse(path: str, message: str) -> ApiError:
    return ApiError(400, f"{path}: {message}", path.split("[", 1)[0].split(".", 1)[0])


def template_message(message: Any, i: int, role: str, text: str) -> dict[str, Any]:
    """One message as the template sees it."""
    out: dict[str, Any] = {"role": role, "content": text}
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if role == "assistant":
        if message.tool_calls:
            out["tool_calls"] = [template_call(call, f"messages[{i}].tool_calls[{j}]")
                                 for j, call in enumerate(message.tool_calls)]
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def template_call(call: object, path: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise refuse(path, "assistant tool_calls entries must be objects.")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise refuse(path, "chat completions only support assistant tool_calls of type 'function'.")
    out = {key: call[key] for key in ("id", "type") if key in call}
    out["function"] = {**function, "arguments": arguments_object(function.get("arguments"))}
    return out


def arguments_object(arguments: object) -> dict:
    """Templates take a call's arguments as a mapping; vLLM reads bad JSON or a non-object as ``{}``."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def render(tokenizer: ModelTokenizer | None, messages: list, text_of: Callable[[Any, int], str],
           role_of: Callable[[str], str], add_generation_prompt: bool | None,
           template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
           continue_final: bool = False) -> list[int]:
    """The conversation's token ids, its template given ``tools`` (the request's ``chat_template_kwargs`` win, as
    vLLM merges them); refusals name the OpenAI parameter, as the scheduler's own rendering does."""
    if tokenizer is None:
        raise refuse("messages", "this executor has no tokenizer; send the prompt as tokens")
    tokenizer.check_chat(len(messages), template_kwargs)  # InvalidRequest: answered as the scheduler's refusals
    shown = []
    for i, message in enumerate(messages):
        role = role_of(message.role)
        if role not in CHAT_ROLES:
            raise refuse(f"messages[{i}].role", f"unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        shown.append(template_message(message, i, role, text_of(message, i)))
    variables = {**({"tools": tools} if tools else {}), **(template_kwargs or {})}
    if continue_final:
        shown[-1]["content"] = (shown[-1]["content"] or "") + CONTINUE_TAG
    try:
        text = tokenizer.template.render(
            **variables, messages=shown, add_generation_prompt=not continue_final if add_generation_prompt is None
            else add_generation_prompt, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
            pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token)
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise refuse("messages", f"the chat template refused the conversation: {e}") from e
    return tokenizer.encode(open_final_message(text) if continue_final else text, add_special_tokens=False)
