"""vLLM's ``POST /reset_prefix_cache``: the cache's entries no request holds are dropped, so the next identical prompt
finds nothing cached; ``success`` is false while a request in flight holds named blocks (it runs on unharmed);
preempting running requests for it is refused naming the parameter; the API key guards it."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.http_fixtures import hosted
from tests.test_http_request_ids import shadow

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
KEY = {"Authorization": "Bearer secret"}


def cached_tokens(url: str) -> int:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=KEY, timeout=30)
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_reset_drops_what_no_request_holds() -> None:
    with hosted(shadow(slow=True), api_key="secret") as api:
        cached_tokens(api.url)
        assert cached_tokens(api.url) > 0, "the second time, the prompt is found in the cache"
        assert httpx.post(f"{api.url}/reset_prefix_cache", timeout=30).status_code == 401
        reset = httpx.post(f"{api.url}/reset_prefix_cache", headers=KEY, timeout=30)
        assert reset.json() == {"success": True}
        assert cached_tokens(api.url) == 0, "nothing left to find"

        chunks: list[str] = []
        body = {"prompt": PROMPT + " Longer.", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

        def read() -> None:
            with httpx.stream("POST", f"{api.url}/v1/completions", json=body, headers=KEY, timeout=60) as answer:
                chunks.extend(line for line in answer.iter_lines() if line.startswith("data: {"))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not chunks and time.monotonic() < deadline:  # its first token: its prompt's blocks are named
            time.sleep(0.01)
        held = httpx.post(f"{api.url}/reset_prefix_cache", headers=KEY, timeout=30)
        assert held.json() == {"success": False}, "a request in flight holds named blocks"
        refused = httpx.post(f"{api.url}/reset_prefix_cache?reset_running_requests=true", headers=KEY, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"
        reader.join(60)
        assert json.loads(chunks[-1].removeprefix("data: "))["usage"]["completion_tokens"] == 1500, "it ran on"
        assert httpx.post(f"{api.url}/reset_prefix_cache", headers=KEY, timeout=30).json() == {"success": True}
        api.assert_idle()
