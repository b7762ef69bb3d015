"""vLLM's ``/v1/chat/completions/batch``: each conversation answered as ``/v1/chat/completions`` answers it alone,
choice ``i`` for conversation ``i``, the usage summed, the id as the header or body names it; what a batch cannot do
is refused naming the parameter (and the conversation), and a refusal leaves nothing queued."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.http_fixtures import Hosted, hosted
from tests.test_http_request_ids import shadow

CONVERSATIONS = [[{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 [{"role": "user", "content": "A third one, longer than the others"}]]
SHARED = {"max_tokens": 6, "temperature": 0.7, "seed": 3, "return_token_ids": True}


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with hosted(shadow(), api_process=request.param) as h:
        yield h
        h.assert_idle()


def post(api: Hosted, path: str, body: dict, **options: object) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, timeout=30, **options)


def test_each_conversation_is_answered_as_it_would_be_alone(api: Hosted) -> None:
    answer = post(api, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, **SHARED},
                  headers={"X-Request-Id": "b7"})
    assert answer.status_code == 200, answer.text
    batch = answer.json()
    alone = [post(api, "/v1/chat/completions", {"messages": m, **SHARED}).json() for m in CONVERSATIONS]
    assert batch["id"] == "chatcmpl-b7" and batch["object"] == "chat.completion"
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in batch["choices"]] == [a["choices"][0]["token_ids"] for a in alone]
    assert [c["message"]["content"] for c in batch["choices"]] == [a["choices"][0]["message"]["content"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)


@pytest.mark.parametrize(("change", "param"), [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"messages": []}, "messages"), ({"messages": [[]]}, "messages"), ({"temperature": -1}, "temperature"),
])
def test_what_a_batch_cannot_do_is_refused_naming_the_parameter(api: Hosted, change: dict, param: str) -> None:
    answer = post(api, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, **SHARED, **change})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_a_refused_conversation_names_itself_and_leaves_nothing_queued(api: Hosted) -> None:
    bad = [CONVERSATIONS[0], [{"role": "robot", "content": "x"}]]
    answer = post(api, "/v1/chat/completions/batch", {"messages": bad, "max_tokens": 400, "ignore_eos": True})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("conversation 1: messages[0]")
    api.assert_idle()
