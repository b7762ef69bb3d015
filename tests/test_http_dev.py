"""vLLM's dev-mode routes (--server-dev-mode): ``/reset_prefix_cache`` drops the cache's entries no request holds;
``/pause`` holds new requests until ``/resume`` and aborts (``abort``), finishes (``wait``) or freezes (``keep``) those
in flight, every token still exact and every block freed after; without the flag none is served."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.http_fixtures import Hosted, hosted
from tests.test_http_request_ids import shadow

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
KEY = {"Authorization": "Bearer secret"}
LONG = 1500


@pytest.fixture(scope="module")
def api() -> Iterator[Hosted]:
    with hosted(shadow(slow=True), api_key="secret", server_dev_mode=True) as h:
        yield h
        h.assert_idle()


class Stream:
    """A streamed completion read on a thread of its own: its chunks as they come."""

    def __init__(self, api: Hosted, prompt: str = PROMPT, max_tokens: int = LONG) -> None:
        self.chunks: list[dict] = []
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}

        def read() -> None:
            with httpx.stream("POST", f"{api.url}/v1/completions", json=body, headers=KEY, timeout=60) as answer:
                self.chunks.extend(json.loads(line.removeprefix("data: ")) for line in answer.iter_lines()
                                   if line.startswith("data: {"))

        self.thread = threading.Thread(target=read)
        self.thread.start()

    def started(self, timeout_s: float = 10) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self.chunks)

    def token_ids(self) -> list[int]:
        self.thread.join(60)
        return [t for c in self.chunks if c["choices"] for t in c["choices"][0]["token_ids"] or ()]

    def result(self) -> tuple[str | None, int]:
        """The finish reason and the completion's tokens, once the stream ended."""
        self.thread.join(60)
        finish = next(c["choices"][0]["finish_reason"] for c in reversed(self.chunks) if c["choices"])
        return finish, self.chunks[-1]["usage"]["completion_tokens"]


def post(api: Hosted, path: str) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", headers=KEY, timeout=60)


def paused(api: Hosted) -> bool:
    return httpx.get(f"{api.url}/is_paused", headers=KEY, timeout=10).json()["is_paused"]


def cached_tokens(api: Hosted) -> int:
    answer = httpx.post(f"{api.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=KEY, timeout=30)
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_keep_freezes_what_runs_and_holds_what_comes_until_the_resume(api: Hosted) -> None:
    running = Stream(api)
    assert running.started()
    assert post(api, "/pause?mode=keep").json() == {"status": "paused"} and paused(api)
    time.sleep(0.3)  # the plan in flight lands
    frozen = len(running.chunks)
    waiting = Stream(api, "Another prompt", 5)
    time.sleep(0.5)
    assert len(running.chunks) == frozen and not waiting.chunks, "no step runs while paused with keep"
    assert post(api, "/resume").json() == {"status": "resumed"} and not paused(api)
    assert running.result() == ("length", LONG) and waiting.result() == ("length", 5)
    unpaused = httpx.post(f"{api.url}/v1/completions", headers=KEY, timeout=60, json={
        "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "return_token_ids": True}).json()
    assert running.token_ids() == unpaused["choices"][0]["token_ids"], "the tokens of a run without the pause"
    api.assert_idle()


def test_wait_answers_once_what_ran_has_finished(api: Hosted) -> None:
    running = Stream(api, max_tokens=300)
    assert running.started()
    assert post(api, "/pause?mode=wait&clear_cache=false").status_code == 200
    stats = api.server.frontend.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks, "idle when the pause answered"
    assert running.result() == ("length", 300)
    waiting = Stream(api, "Held back", 4)
    time.sleep(0.3)
    assert not waiting.chunks and paused(api)
    post(api, "/resume")
    assert waiting.result() == ("length", 4)
    api.assert_idle()


def test_abort_ends_what_runs_and_clears_the_cache(api: Hosted) -> None:
    cached_tokens(api)
    running = Stream(api)
    assert running.started()
    assert post(api, "/pause").json() == {"status": "paused"}, "abort is the default mode"
    finish, tokens = running.result()
    assert finish == "abort" and tokens < LONG
    post(api, "/resume")
    assert cached_tokens(api) == 0, "clear_cache (the default) dropped the prefix cache"
    api.assert_idle()


def test_a_held_request_whose_client_left_is_dropped(api: Hosted) -> None:
    post(api, "/pause?mode=keep")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.url}/v1/completions", json={"prompt": "Gone", "max_tokens": 3}, headers=KEY, timeout=0.5)
    deadline = time.monotonic() + 5
    while api.server.frontend.stats().num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.server.frontend.stats().num_waiting == 0, "no longer waiting once its client left"
    post(api, "/resume")
    api.assert_idle()


def test_a_reset_drops_what_no_request_holds(api: Hosted) -> None:
    cached_tokens(api)
    assert cached_tokens(api) > 0, "the second time, the prompt is found in the cache"
    assert httpx.post(f"{api.url}/reset_prefix_cache", timeout=30).status_code == 401
    assert post(api, "/reset_prefix_cache").json() == {"success": True}
    assert cached_tokens(api) == 0, "nothing left to find"
    running = Stream(api, PROMPT + " Longer.")
    assert running.started()  # its first token: its prompt's blocks are named
    assert post(api, "/reset_prefix_cache").json() == {"success": False}, "a request in flight holds named blocks"
    refused = post(api, "/reset_prefix_cache?reset_running_requests=true")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"
    assert running.result() == ("length", LONG), "it ran on"
    assert post(api, "/reset_prefix_cache").json() == {"success": True}
    api.assert_idle()


def test_a_mode_that_is_none_of_the_three_is_refused(api: Hosted) -> None:
    refused = post(api, "/pause?mode=sleep")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode" and not paused(api)


def test_without_the_flag_no_dev_route_is_served() -> None:
    with hosted(shadow()) as api:
        for path in ("/pause", "/resume", "/reset_prefix_cache"):
            assert httpx.post(f"{api.url}{path}", timeout=10).status_code == 404
        assert httpx.get(f"{api.url}/is_paused", timeout=10).status_code == 404
