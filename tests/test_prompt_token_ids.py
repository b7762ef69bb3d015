"""vLLM's ``return_token_ids``: the prompt's token ids come back, as the model read them (the chat template applied),
once: on the gRPC stream's first response (``return_prompt_token_ids``) and the Python client's completions; in the
HTTP API on a chat completion (streamed: each choice's role chunk) and on each text choice (its first chunk); and
vLLM's ``return_prompt_text``, the chat prompt's text. Served by the scheduler and by its API process alike; the echo
executor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from client import Client
from scheduler_svc.core.tokenizer import ChatMessage
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import HOST, token_request
from tests.test_service_options import TOKENIZER, echo

PROMPT = TOKENIZER.encode("Hello world", add_special_tokens=False)
TOKENS = {"extra_body": {"return_token_ids": True}}


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def served(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with hosted(echo(), api_process=request.param) as h:
        yield h


@pytest.fixture
def api(served: Hosted) -> Iterator[Hosted]:
    yield served
    served.assert_idle()


def test_the_first_grpc_response_carries_the_prompts_token_ids(api: Hosted):
    request = token_request(PROMPT, 6, ignore_eos=True)
    request.sampling.n = 2
    request.stream_interval = 1
    request.return_prompt_token_ids = True
    responses = list(api.stub.Generate(request))
    assert len(responses) > 2 and list(responses[0].prompt_token_ids) == PROMPT
    assert all(not r.prompt_token_ids for r in responses[1:])
    once = token_request(PROMPT, 3, ignore_eos=True)
    once.return_prompt_token_ids = True
    assert list(api.stub.GenerateOnce(once).prompt_token_ids) == PROMPT
    assert not any(r.prompt_token_ids for r in api.stub.Generate(token_request(PROMPT, 3))), "not asked: none"


def test_the_client_returns_a_chats_rendered_prompt(api: Hosted):
    messages = [{"role": "user", "content": "Hi"}]
    rendered = TOKENIZER.encode_chat([ChatMessage("user", "Hi")])
    with Client(f"{HOST}:{api.server.port}") as client:
        assert client.chat(messages, max_tokens=2, return_prompt_token_ids=True).prompt_token_ids == rendered
        assert [c.prompt_token_ids for c in client.choices(token_ids=PROMPT, max_tokens=2, n=2,
                                                           return_prompt_token_ids=True)] == [PROMPT, PROMPT]
        assert client.generate(token_ids=PROMPT, max_tokens=2).prompt_token_ids == []


def test_a_chat_completion_returns_its_prompts_token_ids_as_vllm_does(api: Hosted):
    client = api.openai()
    messages = [{"role": "user", "content": "Hi"}]
    rendered = TOKENIZER.encode_chat([ChatMessage("user", "Hi")])
    reply = client.chat.completions.create(model="echo", messages=messages, max_tokens=3, **TOKENS)
    assert reply.model_extra["prompt_token_ids"] == rendered
    assert reply.choices[0].model_extra["token_ids"] == rendered[:3]
    chunks = list(client.chat.completions.create(model="echo", messages=messages, max_tokens=3, stream=True, **TOKENS))
    assert chunks[0].model_extra["prompt_token_ids"] == rendered, "the first chunk, as vLLM's"
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    plain = client.chat.completions.create(model="echo", messages=messages, max_tokens=3)
    assert "prompt_token_ids" not in plain.model_extra


def test_each_text_choice_returns_its_prompts_token_ids(api: Hosted):
    client = api.openai()
    second = TOKENIZER.encode("The quick", add_special_tokens=False)
    reply = client.completions.create(model="echo", prompt=[PROMPT, second], max_tokens=2, n=2, **TOKENS)
    assert [c.model_extra["prompt_token_ids"] for c in reply.choices] == [PROMPT, PROMPT, second, second]
    assert [c.model_extra["token_ids"] for c in reply.choices] == [PROMPT[:2]] * 2 + [second[:2]] * 2
    chunks = list(client.completions.create(model="echo", prompt=[PROMPT, second], max_tokens=2, n=2, stream=True,
                                            **TOKENS))
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, (choice.model_extra or {}).get("prompt_token_ids"))
    assert firsts == {0: PROMPT, 1: PROMPT, 2: second, 3: second}, "on each choice's first chunk"
    sent = [c.model_extra.get("prompt_token_ids") for chunk in chunks for c in chunk.choices]
    assert sum(ids is not None for ids in sent) == 4, "once each"
    echoed = client.completions.create(model="echo", prompt=PROMPT, max_tokens=2, echo=True, **TOKENS)
    assert echoed.choices[0].model_extra["token_ids"] == PROMPT[:2], "vLLM's: the completion's ids, echo or not"
    assert echoed.choices[0].model_extra["prompt_token_ids"] == PROMPT
    streamed = list(client.completions.create(model="echo", prompt=PROMPT, max_tokens=2, echo=True, stream=True,
                                              **TOKENS))
    ids = [i for chunk in streamed for c in chunk.choices for i in (c.model_extra.get("token_ids") or [])]
    assert ids == PROMPT[:2]
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] == PROMPT  # on the echo chunk



def test_a_chat_completion_returns_its_prompts_text_as_vllm_does(api: Hosted):
    client = api.openai()
    messages = [{"role": "user", "content": "Hi"}]
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # what the ChatML template makes of it
    asked = {"extra_body": {"return_prompt_text": True}}
    reply = client.chat.completions.create(model="echo", messages=messages, max_tokens=2, **asked)
    assert reply.model_extra["prompt_text"] == text
    assert "prompt_token_ids" not in reply.model_extra, "the ids only with return_token_ids"
    chunks = list(client.chat.completions.create(model="echo", messages=messages, max_tokens=2, n=2, stream=True,
                                                 **asked))
    assert [c.model_extra.get("prompt_text") for c in chunks if "prompt_text" in c.model_extra] == [text], \
        "on the first chunk only"
