"""A scheduler + echo executor pair, as subprocesses, for the client tests.

The echo executor completes each prompt with itself, repeated, so a test can predict
the exact text and token ids a user should see. It gets the small byte-level tokenizer
and the ChatML template of the scheduler tests, so text and chat prompts work too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer

from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    TOKENIZER_VOCAB_SIZE,
    byte_level_tokenizer,
    executor_argv,
    free_port,
    running_stack,
)


@dataclass
class EchoServer:
    """Where the stack listens, and the tokenizer it uses, to predict its answers."""

    target: str
    tokenizer: Tokenizer

    def echo(self, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
        """The text and token ids the echo executor answers ``prompt`` with."""
        ids = self.tokenizer.encode(prompt).ids
        completion = [ids[i % len(ids)] for i in range(max_tokens)]
        return self.tokenizer.decode(completion), completion

    def chat_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """Tokens of ``messages`` rendered with the ChatML template, assistant header included."""
        model_tokenizer = ModelTokenizer(self.tokenizer.to_str(), CHATML_TEMPLATE)
        return len(model_tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in messages]))


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EchoServer]:
    folder = tmp_path_factory.mktemp("echo")
    tokenizer = byte_level_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "template.jinja").write_text(CHATML_TEMPLATE)
    options = {"vocab_size": TOKENIZER_VOCAB_SIZE, "tokenizer_json": folder / "tokenizer.json",
               "chat_template": folder / "template.jinja", "max_model_len": 256}
    port = free_port()
    with running_stack(executor_argv("echo", port, options), folder / "logs", executor_port=port) as stack:
        yield EchoServer(stack.target, tokenizer)
