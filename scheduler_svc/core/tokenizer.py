"""Text in and out: the executor's tokenizer.json and chat template, so the scheduler needs no model files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.step import ExecutorInfo
from scheduler_svc.core.errors import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")
# What the server passes every chat template itself.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    """Templates call ``raise_exception`` (as Hugging Face templates do) to refuse a conversation."""
    raise jinja2.TemplateError(message)


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ModelTokenizer:
    """Encodes prompts, renders chat conversations and decodes completion tokens."""

    def __init__(self, tokenizer_json: str, chat_template: str = "", bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.template = self._compile(chat_template) if chat_template else None
        self.bos_token = self._token_text(bos_token_id)
        self.eos_token = self._token_text(eos_token_ids[0] if eos_token_ids else None)

    @classmethod
    def from_info(cls, info: ExecutorInfo) -> ModelTokenizer | None:
        """The handshake's tokenizer, or None when the executor has none (then only token prompts work)."""
        if not info.tokenizer_json:
            return None
        return cls(info.tokenizer_json, info.chat_template, info.bos_token_id, tuple(info.eos_token_ids))

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    @staticmethod
    def _compile(source: str) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(source)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, object] | None = None) -> str:
        """The conversation as the model saw such text in training; raises InvalidRequest naming the bad part.
        ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``), not its own."""
        if taken := sorted(TEMPLATE_VARIABLES.intersection(template_kwargs or ())):
            raise InvalidRequest("chat.template_kwargs", f"{', '.join(taken)}: set by the server, not by a request")
        if self.template is None:
            raise InvalidRequest("chat", "the model has no chat template; send a text or token prompt instead")
        if not messages:
            raise InvalidRequest("chat.messages", "the conversation is empty")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"chat.messages[{i}].role", f"unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}"
                )
        try:
            return self.template.render(
                **(template_kwargs or {}),
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequest("chat", f"the chat template refused the conversation: {e}") from e

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, object] | None = None) -> list[int]:
        """Token ids of the rendered conversation; the template already writes any special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, template_kwargs), add_special_tokens=False)
