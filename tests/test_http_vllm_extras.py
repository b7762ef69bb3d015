"""vLLM's extra parameters over HTTP: prompt_logprobs in vLLM's shape (on completion choices, at the top of a chat
completion, refused with a stream); allowed_token_ids and bad_words passed on to the executor (their effect on
tokens is tested over gRPC on SmolLM2, test_token_masks_service), with vLLM's refusals; a chat's final message
continued (continue_final_message) and echoed before the answer."""

from __future__ import annotations

import json

import httpx
import pytest

from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.api.http import translate
from scheduler_svc.api.http.schemas import CompletionRequest
from tests.http_fixtures import hosted
from tests.service_fixtures import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE
from tests.shadow_helpers import shadow_prompt_logprobs
from tests.test_service_loop import LogprobExecutor
from tests.test_service_options import TOKENIZER, TOKENIZER_JSON, echo

PROMPT, VOCAB = [3, 9, 4, 7], 50


def test_prompt_logprobs_come_in_vllms_shape():
    with hosted(LogprobExecutor(ShadowExecutor(num_blocks=64, block_size=4, vocab_size=VOCAB))) as h:
        model = httpx.get(f"{h.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
        choices = httpx.post(f"{h.url}/v1/completions", json=body, timeout=30).json()["choices"]
        plain = httpx.post(f"{h.url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=30).json()
        streamed = httpx.post(f"{h.url}/v1/completions", json={**body, "stream": True}, timeout=30)
        too_many = httpx.post(f"{h.url}/v1/completions", json={**body, "prompt_logprobs": 21}, timeout=30)
        h.assert_idle()
    chatting = ShadowExecutor(num_blocks=64, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE,
                              tokenizer_json=TOKENIZER_JSON, chat_template=CHATML_TEMPLATE)
    with hosted(LogprobExecutor(chatting)) as h:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 1}
        chatted = httpx.post(f"{h.url}/v1/chat/completions", json=chat, timeout=30).json()
        h.assert_idle()
    scored = shadow_prompt_logprobs(PROMPT, VOCAB, 2)
    for choice in choices:  # every choice of the prompt carries them, as vLLM's
        logprobs = choice["prompt_logprobs"]
        assert logprobs[0] is None and len(logprobs) == len(PROMPT)
        for token_id, entry, (logprob, top_ids) in zip(PROMPT[1:], logprobs[1:], scored, strict=True):
            assert entry[str(token_id)]["logprob"] == pytest.approx(logprob)
            assert entry[str(token_id)]["decoded_token"] == f"token_id:{token_id}"
            assert [entry[str(t)]["rank"] for t in top_ids] == [1, 2]
            assert set(entry) == {str(token_id), *map(str, top_ids)}
    assert "prompt_logprobs" not in plain["choices"][0]
    assert "prompt_logprobs" in chatted, chatted
    assert chatted["prompt_logprobs"][0] is None and len(chatted["prompt_logprobs"]) > 2
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_allowed_token_ids_and_bad_words_reach_the_request_as_vllm_sends_them():
    served = translate.Served("m")
    body = CompletionRequest(prompt="Hi", allowed_token_ids=[5, 9], bad_words=["Paris", "the sky"])
    [request] = translate.completion_request(body, served, None).requests
    assert list(request.sampling.allowed_token_ids.token_ids) == [5, 9]
    assert list(request.sampling.bad_words) == ["Paris", "the sky"]
    [empty] = translate.completion_request(CompletionRequest(prompt="Hi", allowed_token_ids=[]), served,
                                           None).requests
    assert empty.sampling.HasField("allowed_token_ids"), "sent empty, for the scheduler to refuse as vLLM does"
    [unset] = translate.completion_request(CompletionRequest(prompt="Hi"), served, None).requests
    assert not unset.sampling.HasField("allowed_token_ids") and not unset.sampling.bad_words


CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
NO_CALLS = {"tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


def test_continue_final_message_and_echo_go_on_from_the_assistants_message_as_vllm():
    with hosted(echo()) as h:
        def post(path: str, **body: object) -> httpx.Response:
            return httpx.post(f"{h.url}/v1/chat/completions{path}", json={"messages": CONVERSATION, **body}, timeout=30)

        rendered = {name: TOKENIZER.decode(post("/render", **body).json()["token_ids"], skip_special_tokens=False)
                    for name, body in (("open", {"continue_final_message": True}), ("closed", {}),
                                       ("open, tools", {"continue_final_message": True, **NO_CALLS}))}
        both = post("", continue_final_message=True, add_generation_prompt=True)
        whole = post("", echo=True, continue_final_message=True, max_tokens=3).json()
        streamed = post("", echo=True, continue_final_message=True, max_tokens=3, stream=True).text
        h.assert_idle()
    assert rendered["open"].endswith("<|im_start|>assistant\nThe answer is"), rendered["open"]
    assert rendered["open, tools"] == rendered["open"]
    assert rendered["closed"].endswith("The answer is<|im_end|>\n<|im_start|>assistant\n")
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert whole["choices"][0]["message"]["content"].startswith("The answer is")
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "The answer is"}]
    assert "".join(d.get("content") or "" for d in deltas) == whole["choices"][0]["message"]["content"]
