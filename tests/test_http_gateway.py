"""What gateways probe over HTTP: ``/version`` and ``/server_info`` say what this worker is, and the render routes
give the token ids a completion or chat request becomes (vLLM's shapes), refusing what the request would refuse."""

from __future__ import annotations

from importlib.metadata import version

import httpx
import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import CHATML_TEMPLATE, EOS_ID, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_level_tokenizer().to_str()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_json, CHATML_TEMPLATE, None, (EOS_ID,))


@pytest.fixture(scope="module")
def api(tokenizer_json: str) -> Hosted:
    executor = ShadowExecutor(num_blocks=64, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                              tokenizer_json=tokenizer_json, chat_template=CHATML_TEMPLATE)
    with hosted(executor, max_num_seqs=7, max_num_batched_tokens=512, scheduling_policy="mixed") as h:
        yield h
        h.assert_idle()


def post(api: Hosted, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, timeout=10)


def test_version_and_server_info_say_what_this_worker_is(api: Hosted) -> None:
    assert httpx.get(f"{api.url}/version", timeout=10).json() == {"version": version("nanoserve")}
    info = httpx.get(f"{api.url}/server_info", timeout=10).json()
    assert info["engine"] == "nanoserve" and info["model"] == "shadow-kv"
    assert (info["block_size"], info["num_kv_blocks"], info["max_model_len"]) == (4, 64, MAX_MODEL_LEN)
    assert (info["max_num_seqs"], info["max_num_batched_tokens"], info["scheduling_policy"]) == (7, 512, "mixed")
    assert info["num_waiting"] == info["num_running"] == info["num_used_blocks"] == 0
    assert info["kv_cache_usage"] == 0.0 and info["uptime_s"] >= 0
    card = httpx.get(f"{api.url}/v1/models", timeout=10).json()["data"][0]
    assert card["root"] == card["id"] == "shadow-kv"


def test_a_completion_renders_to_its_prompts_token_ids(api: Hosted, tokenizer: ModelTokenizer) -> None:
    answer = post(api, "/v1/completions/render", {"prompt": ["Hello world", "The quick brown fox"], "max_tokens": 5})
    assert answer.status_code == 200
    rendered = answer.json()
    assert [r["token_ids"] for r in rendered] == [tokenizer.encode("Hello world"),
                                                   tokenizer.encode("The quick brown fox")]
    assert rendered[0]["model"] == "shadow-kv" and rendered[0]["request_id"].startswith("cmpl-")
    assert rendered[0]["sampling_params"]["max_tokens"] == 5 and rendered[0]["sampling_params"]["n"] == 1
    ids = [5, 6, 7, 8]
    assert post(api, "/v1/completions/render", {"model": "shadow-kv", "prompt": ids}).json()[0]["token_ids"] == ids
    usage = api.openai().completions.create(model="shadow-kv", prompt="Hello world", max_tokens=2).usage
    assert usage.prompt_tokens == len(rendered[0]["token_ids"]), "what /v1/completions computes"
    defaults = post(api, "/v1/completions/render", {"prompt": "Hello"}).json()[0]["sampling_params"]
    assert defaults["temperature"] == 1.0 and defaults["max_tokens"] == 16, "vLLM's: a completion's default is 16"


def test_a_conversation_renders_through_the_chat_template(api: Hosted, tokenizer: ModelTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld"}]
    rendered = post(api, "/v1/chat/completions/render", {"messages": messages}).json()
    expected = tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in messages])
    assert rendered["token_ids"] == expected and rendered["request_id"].startswith("chatcmpl-")
    bare = post(api, "/v1/chat/completions/render", {"messages": messages[1:], "add_generation_prompt": False}).json()
    assert bare["token_ids"] == tokenizer.encode_chat([ChatMessage("user", "héllo wörld")], False)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions/render", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions/render", {"prompt": [5, 300]}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens"),
    ("/v1/completions/render", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/v1/completions/render", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions/render", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
    ("/v1/chat/completions/render", {"messages": "hi"}, 400, "messages"),
])
def test_a_render_refuses_what_the_request_would_refuse(api: Hosted, path: str, body: dict, status: int,
                                                        param: str) -> None:
    answer = post(api, path, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
