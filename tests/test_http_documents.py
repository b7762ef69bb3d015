"""vLLM's ``documents`` on chat completions: a retrieval-augmented template reads them as its ``documents``, as
Hugging Face's ``apply_chat_template(documents=...)`` hands them over, over ``chat_template_kwargs``' own."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

RAG_TEMPLATE = "{% if documents %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}" + (
    CHATML_TEMPLATE)
DOCUMENTS = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "Of Italy."}]


@pytest.fixture(scope="module")
def api() -> Iterator[Hosted]:
    executor = ShadowExecutor(num_blocks=256, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=512,
                              tokenizer_json=byte_level_tokenizer().to_str(), chat_template=RAG_TEMPLATE)
    with hosted(executor) as h:
        yield h
        h.assert_idle()


def prompt_text(api: Hosted, **body: object) -> str:
    chat = {"messages": [{"role": "user", "content": "Which?"}], "max_tokens": 1, "return_prompt_text": True, **body}
    answer = httpx.post(f"{api.url}/v1/chat/completions", json=chat, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["prompt_text"]


def test_the_template_reads_the_documents_as_vllm_hands_them_over(api: Hosted) -> None:
    both = prompt_text(api, documents=DOCUMENTS)
    assert both.startswith("[Paris: The capital of France.][Rome: Of Italy.]<|im_start|>")
    assert prompt_text(api).startswith("<|im_start|>user"), "none sent: the template renders none"
    given = prompt_text(api, documents=DOCUMENTS[1:], chat_template_kwargs={"documents": DOCUMENTS[:1]})
    assert given.startswith("[Rome: Of Italy.]<|im_start|>"), "documents win over chat_template_kwargs', as vLLM's"
    assert prompt_text(api, chat_template_kwargs={"documents": DOCUMENTS[:1]}).startswith("[Paris")
    assert prompt_text(api, documents=[], chat_template_kwargs={"documents": DOCUMENTS}).startswith("<|im_start|>")
    effort = prompt_text(api, documents=DOCUMENTS[:1], reasoning_effort="low")
    assert effort.startswith("[Paris: The capital of France.]<|im_start|>")
