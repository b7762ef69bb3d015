"""Text in and out: the executor's tokenizer.json and chat template, so the scheduler needs no model files."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.step import ExecutorInfo, SpecialTokens
from scheduler_svc.core.errors import InvalidRequest

log = logging.getLogger("nanoserve.scheduler")

CHAT_ROLES = ("system", "user", "assistant", "tool")
# What the server passes every chat template itself.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                                "unk_token"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    """Templates call ``raise_exception`` (as Hugging Face templates do) to refuse a conversation."""
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (Jinja's own escapes HTML and takes only indent)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """transformers' ``strftime_now``: templates date their system prompt with it."""
    return datetime.now().strftime(format)


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it for training masks
    (TRL fine-tunes' templates keep it); serving renders the body alone."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: object) -> str:
        return caller()


# Marks where the final message's content ends, for continue_final_message (transformers' own tag).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def open_final_message(rendered: str) -> str:
    """The rendered conversation cut where the final message's content (``CONTINUE_TAG`` after it) ends, as
    transformers cuts it: a model continues that message instead of starting a turn."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidRequest("chat.continue_final_message", "the chat template drops the final message's end, so it "
                                                            "cannot be continued")
    return rendered[:at] if rendered.startswith(CONTINUE_TAG, at) else rendered[:at].rstrip()


class ModelTokenizer:
    """Encodes prompts, renders chat conversations and decodes completion tokens."""

    def __init__(self, tokenizer_json: str, chat_template: str = "", bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), special_tokens: SpecialTokens | None = None) -> None:
        """``special_tokens``: the tokenizer's own, which the template renders; None (an executor that sent none):
        the tokens of ``bos_token_id`` and ``eos_token_ids[0]``."""
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.template: jinja2.Template | None = None
        # Why the chat template does not compile: chat prompts are refused with it, the rest still work.
        self.template_error = ""
        if chat_template:
            try:
                self.template = self._compile(chat_template)
            except jinja2.TemplateError as e:
                line = f"line {e.lineno}: " if getattr(e, "lineno", None) else ""
                self.template_error = f"{line}{e.message or type(e).__name__}"
        if special_tokens is None:
            special_tokens = SpecialTokens(self._token_text(bos_token_id),
                                           self._token_text(eos_token_ids[0] if eos_token_ids else None))
        self.bos_token = special_tokens.bos_token or ""
        self.eos_token = special_tokens.eos_token or ""
        self.pad_token = special_tokens.pad_token or ""
        self.unk_token = special_tokens.unk_token or ""

    def with_template(self, chat_template: str) -> ModelTokenizer:
        """This tokenizer, rendering with ``chat_template`` (a request's, vLLM's); jinja2.TemplateError where it does
        not compile."""
        other = copy.copy(self)
        other.template, other.template_error = self._compile(chat_template), ""
        return other

    @classmethod
    def from_info(cls, info: ExecutorInfo) -> ModelTokenizer | None:
        """The handshake's tokenizer, or None when the executor has none (then only token prompts work)."""
        if not info.tokenizer_json:
            return None
        tokenizer = cls(info.tokenizer_json, info.chat_template, info.bos_token_id, tuple(info.eos_token_ids),
                        info.special_tokens)
        if tokenizer.template_error:
            log.error("the model's chat template does not compile (%s): chat requests will be refused; text and "
                      "token prompts work", tokenizer.template_error)
        return tokenizer

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    @staticmethod
    def _compile(source: str) -> jinja2.Template:
        """In the environment transformers renders chat templates in (``chat_template_utils``)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationBlock, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(source)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's strings of these ids (``Ġworld``, not decoded text: vLLM's ``token_strs``)."""
        return [self._token_text(token_id) for token_id in token_ids]

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (a marker such as ``</think>``), None if it is not one."""
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, object] | None = None, continue_final: bool = False) -> str:
        """The conversation as the model saw such text in training; raises InvalidRequest naming the bad part.
        ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``), not its own;
        ``continue_final``: the text ends where the final message's content does (``open_final_message``)."""
        self.check_chat(len(messages), template_kwargs)
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequest(
                    f"chat.messages[{i}].role", f"unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}"
                )
        shown = [{"role": m.role, "content": m.content} for m in messages]
        if continue_final:
            shown[-1]["content"] += CONTINUE_TAG
        try:
            text = self.template.render(
                **(template_kwargs or {}),
                messages=shown,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                pad_token=self.pad_token,
                unk_token=self.unk_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise InvalidRequest("chat", f"the chat template refused the conversation: {e}") from e
        return open_final_message(text) if continue_final else text

    def check_chat(self, num_messages: int, template_kwargs: Mapping[str, object] | None) -> None:
        """InvalidRequest, naming the field, where no conversation can be rendered: a template variable a request
        may not set, a template missing or broken, no message."""
        if taken := sorted(TEMPLATE_VARIABLES.intersection(template_kwargs or ())):
            raise InvalidRequest("chat.template_kwargs", f"{', '.join(taken)}: set by the server, not by a request")
        if self.template_error:
            raise InvalidRequest("chat", f"the model's chat template does not compile ({self.template_error}); fix "
                                         "it in the model folder, or send a text or token prompt instead")
        if self.template is None:
            raise InvalidRequest("chat", "the model has no chat template; send a text or token prompt instead")
        if not num_messages:
            raise InvalidRequest("chat.messages", "the conversation is empty")

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, object] | None = None, continue_final: bool = False) -> list[int]:
        """Token ids of the rendered conversation; the template already writes any special tokens."""
        text = self.render_chat(messages, add_generation_prompt, template_kwargs, continue_final)
        return self.encode(text, add_special_tokens=False)
