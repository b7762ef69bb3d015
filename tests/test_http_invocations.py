"""SageMaker's routes as vLLM serves them: ``/ping`` answers as ``/health``, ``/invocations`` takes a chat completion
(a body with ``messages``) or a completion (``prompt``), streamed or not, and refuses anything else naming what to
send; as on vLLM, neither needs the API key (SageMaker authorizes its callers and sends none). Served by the scheduler
and by its API process alike; the echo executor."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.http_fixtures import Hosted, hosted
from tests.test_service_options import TOKENIZER, echo

PROMPT = TOKENIZER.encode("Hello world", add_special_tokens=False)


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def served(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with hosted(echo(), api_process=request.param) as h:
        yield h


@pytest.fixture
def api(served: Hosted) -> Iterator[Hosted]:
    yield served
    served.assert_idle()


def test_ping_is_health(api: Hosted):
    assert httpx.get(f"{api.url}/ping").status_code == 200
    assert httpx.post(f"{api.url}/ping").status_code == 200


def test_invocations_answer_a_chat_or_a_completion_by_the_bodys_shape(api: Hosted):
    chat = httpx.post(f"{api.url}/invocations", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 3}, timeout=30).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    text = httpx.post(f"{api.url}/invocations", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30).json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == TOKENIZER.decode(PROMPT[:2])
    with httpx.stream("POST", f"{api.url}/invocations", json={"prompt": PROMPT, "max_tokens": 2, "stream": True},
                      timeout=30) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == TOKENIZER.decode(PROMPT[:2])


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "echo"}, "messages"), ([1, 2], "messages"), ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"messages": "Hi"}, "messages")])
def test_invocations_refuse_what_is_neither_naming_the_field(api: Hosted, body: object, param: str):
    answer = httpx.post(f"{api.url}/invocations", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert httpx.post(f"{api.url}/invocations", content=b"{not json", timeout=30).status_code == 400


def test_sagemakers_routes_answer_without_the_api_key_as_on_vllm():
    with hosted(echo(), api_key="secret") as h:
        body = {"prompt": PROMPT, "max_tokens": 1}
        assert httpx.post(f"{h.url}/invocations", json=body, timeout=30).status_code == 200
        assert httpx.get(f"{h.url}/ping").status_code == 200
        assert httpx.post(f"{h.url}/v1/completions", json=body, timeout=30).status_code == 401
        h.assert_idle()
