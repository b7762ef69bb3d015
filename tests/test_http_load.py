"""vLLM's ``GET /load``: with --enable-server-load-tracking, the chat, completion, response and generate requests the
HTTP API is answering, from arrival until the answer's last byte (a stream's too); 0 without the flag, as vLLM
answers. Open without the API key, as on vLLM. Served where the generation routes are answered: the API process, or the
scheduler."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.http_fixtures import Hosted, hosted
from tests.test_http_responses import CONVERSATION, SlowEcho
from tests.test_http_tools import echo_last


def slow(**config: object) -> Iterator[Hosted]:
    return hosted(SlowEcho(echo_last(CONVERSATION).info), **config)


def load(api: Hosted) -> int:
    answer = httpx.get(f"{api.url}/load", timeout=10)
    assert answer.status_code == 200
    return answer.json()["server_load"]


def settles_at(api: Hosted, value: int) -> bool:
    deadline = time.monotonic() + 5
    while load(api) != value and time.monotonic() < deadline:
        time.sleep(0.01)
    return load(api) == value


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_load_counts_the_answers_in_flight_streams_to_their_end(api_process: bool):
    with slow(api_process=api_process, enable_server_load_tracking=True, api_key="secret") as api:
        headers = {"Authorization": "Bearer secret"}
        # Steps of 20 ms: the chat streams for 4 s, the response for 0.2 s within it.
        chat = {"model": "tools", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        response = {"model": "tools", "input": "Hi", "max_output_tokens": 10, "ignore_eos": True, "stream": True}
        assert load(api) == 0
        with httpx.stream("POST", f"{api.url}/v1/chat/completions", json=chat, headers=headers, timeout=30) as one:
            first = one.iter_lines()
            next(first)
            assert load(api) == 1
            with httpx.stream("POST", f"{api.url}/v1/responses", json=response, headers=headers, timeout=30) as two:
                second = two.iter_lines()
                next(second)
                assert load(api) == 2
                list(second)
            assert settles_at(api, 1)
            generate = {"token_ids": [1, 2, 3], "stream": True,
                        "sampling_params": {"max_tokens": 10, "ignore_eos": True}}
            with httpx.stream("POST", f"{api.url}/inference/v1/generate", json=generate, headers=headers,
                              timeout=30) as three:
                third = three.iter_lines()
                next(third)
                assert load(api) == 2
                list(third)
            assert settles_at(api, 1)
            list(first)
        assert settles_at(api, 0)
        refused = httpx.post(f"{api.url}/v1/completions", json={"model": "tools", "prompt": "x"}, timeout=30)
        assert refused.status_code == 401 and settles_at(api, 0)  # refused before it was answered, and not left
        api.assert_idle()


def test_without_the_flag_load_is_zero_as_on_vllm():
    with slow() as api:
        chat = {"model": "tools", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{api.url}/v1/chat/completions", json=chat, timeout=30) as one:
            lines = one.iter_lines()
            next(lines)
            assert load(api) == 0
            list(lines)
        api.assert_idle()
