"""vLLM's serving flags for chat: ``--chat-template`` (a file or the template itself) replaces the model's template
for every chat request, ``--default-chat-template-kwargs`` gives every HTTP chat request its template variables
(the request's own win), ``--enable-force-include-usage`` ends every streamed answer with its usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import build_server
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.grpc_service import executor_client
from scheduler_svc.config import parse_config
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

MINE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def executor_target() -> Iterator[str]:
    executor = ShadowExecutor(num_blocks=256, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=512,
                              tokenizer_json=byte_level_tokenizer().to_str(), chat_template=CHATML_TEMPLATE)
    server, port = build_server(executor, "127.0.0.1", 0)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def prompt_text(api: Hosted, **body: object) -> str:
    answer = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 1, "return_prompt_text": True, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["prompt_text"]


def test_the_flag_takes_a_file_or_the_template_and_refuses_a_missing_file(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(MINE)
    assert parse_config(["--chat-template", str(template)]).chat_template == MINE
    assert parse_config(["--chat-template", MINE]).chat_template == MINE
    assert executor_client(parse_config(["--chat-template", MINE])).chat_template == MINE
    for flags in (["--chat-template", str(tmp_path / "missing.jinja")], ["--chat-template", "chatml.txt"],
                  ["--default-chat-template-kwargs", "[1]"], ["--default-chat-template-kwargs", "{"],
                  ["--default-chat-template-kwargs", '{"add_generation_prompt": false}']):
        with pytest.raises(SystemExit):
            parse_config(flags)


def test_the_chat_template_replaces_the_models_over_http_and_grpc(executor_target: str) -> None:
    with hosted(RemoteExecutor(executor_target, chat_template=MINE)) as api:
        assert prompt_text(api) == "[user] Hi\n[assistant] "
        chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")])
        once = api.stub.GenerateOnce(pb.GenerateRequest(chat=chat, stopping=pb.StoppingOptions(max_tokens=1),
                                                        return_prompt_token_ids=True))
        assert api.server.frontend.tokenizer.decode(list(once.prompt_token_ids), False) == "[user] Hi\n[assistant] "
        api.assert_idle()
    with hosted(RemoteExecutor(executor_target)) as api:
        assert prompt_text(api).startswith("<|im_start|>user\nHi<|im_end|>"), "without the flag: the model's own"


def test_default_template_kwargs_apply_to_every_chat_request_and_a_requests_own_win(executor_target: str) -> None:
    with hosted(RemoteExecutor(executor_target), default_chat_template_kwargs={"enable_thinking": False}) as api:
        assert prompt_text(api).endswith("<think>\n\n</think>\n\n"), "the server's default turns the thinking off"
        assert not prompt_text(api, chat_template_kwargs={"enable_thinking": True}).endswith("</think>\n\n")
        assert not prompt_text(api, reasoning_effort="high").endswith("</think>\n\n"), "the request's effort wins"
        counted = httpx.post(f"{api.url}/tokenize", timeout=30, json={"messages": MESSAGES}).json()["count"]
        used = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, json={"messages": MESSAGES, "max_tokens": 1})
        assert counted == used.json()["usage"]["prompt_tokens"], "/tokenize renders with the defaults too"
        anthropic = httpx.post(f"{api.url}/v1/messages/count_tokens", timeout=30, json={
            "model": api.openai().models.list().data[0].id, "messages": MESSAGES}).json()
        assert anthropic["input_tokens"] == counted, "and Messages' token count"
        api.assert_idle()


def test_forced_usage_ends_every_streamed_answer(executor_target: str) -> None:
    def last_usage(api: Hosted, path: str, body: dict) -> dict | None:
        lines = httpx.post(f"{api.url}{path}", timeout=30, json={**body, "max_tokens": 3, "stream": True}).text
        events = [json.loads(line[6:]) for line in lines.splitlines() if line.startswith("data: {")]
        assert len({event.get("usage") is not None for event in events}) == 1, "every chunk's, or none"
        return events[-1].get("usage")

    with hosted(RemoteExecutor(executor_target), enable_force_include_usage=True) as api:
        usage = last_usage(api, "/v1/chat/completions", {"messages": MESSAGES})
        assert usage is not None and usage["completion_tokens"] == 3
        assert last_usage(api, "/v1/completions", {"prompt": [5, 6, 7]})["prompt_tokens"] == 3
        api.assert_idle()
    with hosted(RemoteExecutor(executor_target)) as api:
        assert last_usage(api, "/v1/completions", {"prompt": [5, 6, 7]}) is None, "without the flag: only when asked"


def test_a_requests_own_template_renders_its_conversation_only_where_the_server_trusts_it(executor_target: str) -> None:
    with hosted(RemoteExecutor(executor_target), trust_request_chat_template=True) as api:
        assert prompt_text(api, chat_template="<{{ messages[0]['content'] }}>") == "<Hi>"
        batch = httpx.post(f"{api.url}/v1/chat/completions/batch", timeout=30, json={
            "messages": [MESSAGES, MESSAGES], "max_tokens": 1, "chat_template": "<{{ messages[0]['content'] }}>"})
        assert [c["finish_reason"] for c in batch.json()["choices"]] == ["length", "length"]
        broken = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, json={
            "messages": MESSAGES, "max_tokens": 1, "chat_template": "{% for %}"})
        assert (broken.status_code, broken.json()["error"]["param"]) == (400, "chat_template")
        assert prompt_text(api).startswith("<|im_start|>user"), "none sent: the model's own"
        api.assert_idle()
    with hosted(RemoteExecutor(executor_target)) as api:
        refused = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, json={
            "messages": MESSAGES, "max_tokens": 1, "chat_template": "<{{ messages[0]['content'] }}>"})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "chat_template")
