"""vLLM's request ids over HTTP: a body's ``request_id``, or the ``X-Request-Id`` header in its place, names the answer
(``chatcmpl-<id>``, ``cmpl-<id>``) and the request, which ``/inference/v1/abort_requests`` then ends by that name;
with --enable-request-id-headers every answer carries the header once (the request's own, or a new one), 401s too,
whichever process answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer
from tests.test_http_generate import SlowShadow

KEY = {"Authorization": "Bearer secret"}


def shadow(slow: bool = False) -> ShadowExecutor:
    kind = SlowShadow if slow else ShadowExecutor
    return kind(num_blocks=1024, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=2048,
                tokenizer_json=byte_level_tokenizer().to_str(), chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with hosted(shadow(), api_process=request.param, api_key="secret", enable_request_id_headers=True) as h:
        yield h
        h.assert_idle()


def test_the_header_or_the_body_names_the_answer(api: Hosted) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "from-body"}
    answer = httpx.post(f"{api.url}/v1/chat/completions", json=chat, headers=KEY, timeout=30)
    assert answer.json()["id"] == "chatcmpl-from-body" and answer.headers["x-request-id"] != "from-body"
    answer = httpx.post(f"{api.url}/v1/chat/completions", json=chat, headers={**KEY, "X-Request-Id": "traced"},
                        timeout=30)
    assert answer.json()["id"] == "chatcmpl-traced", "the header wins, as on vLLM"
    assert answer.headers.get_list("x-request-id") == ["traced"]
    completion = httpx.post(f"{api.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                            headers={**KEY, "X-Request-Id": "c1"}, timeout=30).json()
    assert completion["id"] == "cmpl-c1"
    render = httpx.post(f"{api.url}/v1/completions/render", json={"prompt": "Hi"},
                        headers={**KEY, "X-Request-Id": "r1"}, timeout=30).json()
    assert render[0]["request_id"] == "cmpl-r1"


def test_every_answer_carries_one_request_id_header(api: Hosted) -> None:
    models = httpx.get(f"{api.url}/v1/models", headers=KEY, timeout=30)
    (generated,) = models.headers.get_list("x-request-id")
    assert len(generated) == 32, "a new one where the request sent none"
    refused = httpx.get(f"{api.url}/v1/models", headers={"X-Request-Id": "no-key"}, timeout=30)
    assert refused.status_code == 401 and refused.headers.get_list("x-request-id") == ["no-key"]
    streamed = httpx.post(f"{api.url}/v1/completions", headers={**KEY, "X-Request-Id": "s1"}, timeout=30,
                          json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert streamed.headers.get_list("x-request-id") == ["s1"]


def test_a_chat_stream_is_aborted_by_its_header_id() -> None:
    with hosted(shadow(slow=True)) as api:
        chunks: list[dict] = []

        def read() -> None:
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{api.url}/v1/chat/completions", json=chat, timeout=30,
                              headers={"X-Request-Id": "long-chat"}) as answer:
                chunks.extend(json.loads(line.removeprefix("data: ")) for line in answer.iter_lines()
                              if line.startswith("data: {"))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not api.server.frontend.by_request_id and time.monotonic() < deadline:
            time.sleep(0.01)
        answer = httpx.post(f"{api.url}/inference/v1/abort_requests", json={"request_ids": "chatcmpl-long-chat"},
                            timeout=30)
        reader.join(30)
        assert answer.json()["aborted"] == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and chunks[0]["id"] == "chatcmpl-long-chat"
        api.assert_idle()
