"""vLLM's tokens-in, tokens-out API: ``/inference/v1/generate`` samples what ``/v1/completions`` samples for the same
token ids, takes back what a render route gives, streams a choice's new tokens per event, answers logprobs by token
id as vLLM lists them, refuses what it cannot honour naming the field, and ``/inference/v1/abort_requests`` ends a
request in flight (its blocks freed)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.step import StepPlan, StepResult
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from scheduler_svc.api.http import gateway, translate
from scheduler_svc.api.http.generate_api import inputs
from scheduler_svc.api.http.generate_api.schemas import GenerateRequest
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.http_fixtures import Hosted, hosted, hosted_smollm2
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.service_fixtures import CHATML_TEMPLATE, EOS_ID, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer

MAX_MODEL_LEN = 96
GENERATE = "/inference/v1/generate"


class SlowShadow(ShadowExecutor):
    """Steps of 100 ms: a request is still running when it is aborted."""

    def step(self, plan: StepPlan) -> StepResult:
        time.sleep(0.1)
        return super().step(plan)


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_level_tokenizer().to_str()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_json, CHATML_TEMPLATE, None, (EOS_ID,))


@pytest.fixture(scope="module")
def api(tokenizer_json: str) -> Iterator[Hosted]:
    executor = ShadowExecutor(num_blocks=64, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                          tokenizer_json=tokenizer_json, chat_template=CHATML_TEMPLATE)
    with hosted(executor) as h:
        yield h
        h.assert_idle()


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def slow_api(tokenizer_json: str, request: pytest.FixtureRequest) -> Iterator[Hosted]:
    """Room for a long answer: a plan may decode as many tokens as the API process's paced reader takes at once."""
    executor = SlowShadow(num_blocks=1024, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, max_model_len=2048,
                          tokenizer_json=tokenizer_json, chat_template=CHATML_TEMPLATE)
    with hosted(executor, api_process=request.param) as h:
        yield h


@pytest.fixture(scope="module")
def model_api(smollm2_folder: Path) -> Iterator[Hosted]:  # noqa: F811 - converts the embedded model once
    with hosted_smollm2() as h:
        yield h


def post(api: Hosted, path: str, body: dict, **options: object) -> httpx.Response:
    return httpx.post(f"{api.url}{path}", json=body, timeout=30, **options)


def events(answer: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_rendered_completion_generates_the_tokens_the_completion_route_samples(api: Hosted) -> None:
    rendered = post(api, "/v1/completions/render", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0})
    (render,) = rendered.json()
    answer = post(api, GENERATE, {"token_ids": render["token_ids"], "sampling_params": render["sampling_params"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    completion = api.openai().completions.create(model="shadow-kv", prompt="Hello world", max_tokens=5, temperature=0,
                                                 extra_body={"return_token_ids": True}).choices[0]
    assert body["choices"][0]["token_ids"] == completion.token_ids and len(completion.token_ids) == 5
    assert body["choices"][0]["finish_reason"] == "length" and body["output_mode"] == "tokens"
    assert "text" not in body["choices"][0], "tokens mode carries no text"
    assert body["request_id"].startswith("generate-tokens-") and body["model"] == "shadow-kv"
    assert body["usage"]["prompt_tokens"] == len(render["token_ids"]) and body["usage"]["completion_tokens"] == 5
    assert body["prompt_token_ids"] is None


def test_a_render_keeps_every_parameter_that_shapes_the_tokens(api: Hosted, tokenizer: ModelTokenizer) -> None:
    allowed = tokenizer.encode("abcdefgh")
    body = {"prompt": "Hello", "max_tokens": 10, "temperature": 0.8, "seed": 4, "ignore_eos": True,
            "allowed_token_ids": allowed, "stop_token_ids": allowed[5:6], "bad_words": ["c"],
            "logit_bias": {str(allowed[0]): 5.0}}
    (render,) = post(api, "/v1/completions/render", body).json()
    sampling = render["sampling_params"]
    assert sampling["allowed_token_ids"] == allowed and sampling["bad_words"] == ["c"] and render["priority"] == 0
    answer = post(api, GENERATE, {"token_ids": render["token_ids"], "sampling_params": sampling}).json()
    completion = api.openai().completions.create(model="shadow-kv", **{k: v for k, v in body.items() if k in (
        "prompt", "max_tokens", "temperature", "seed", "logit_bias")}, extra_body={
        "return_token_ids": True, **{k: body[k] for k in ("ignore_eos", "allowed_token_ids", "stop_token_ids",
                                                          "bad_words")}}).choices[0]
    (choice,) = answer["choices"]
    assert choice["token_ids"] == completion.token_ids
    assert (choice["finish_reason"], choice["stop_reason"]) == (completion.finish_reason, completion.stop_reason)


def test_stream_options_without_stream_are_ignored_as_vllm_ignores_them(api: Hosted) -> None:
    answer = post(api, GENERATE, {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2},
                                  "stream_options": {"include_usage": True}})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 2


def test_left_out_max_tokens_is_the_room_the_prompt_leaves(api: Hosted) -> None:
    answer = post(api, GENERATE, {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert answer.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3, "not vLLM's dataclass default of 16"


def test_a_stream_sends_each_choices_new_tokens_then_the_usage(api: Hosted, tokenizer: ModelTokenizer) -> None:
    prompt = tokenizer.encode("The quick brown fox")
    sampling = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True}
    whole = post(api, GENERATE, {"token_ids": prompt, "sampling_params": sampling}).json()
    streamed = events(post(api, GENERATE, {
        "token_ids": prompt, "sampling_params": sampling, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    *chunks, last = streamed
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert sum((c["token_ids"] for c in mine), []) == whole["choices"][index]["token_ids"]
        assert [c["finish_reason"] for c in mine][-1] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in chunks), "continuous usage on every chunk"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12 == whole["usage"]["completion_tokens"]


def test_text_mode_decodes_and_ends_at_a_stop_string(api: Hosted, tokenizer: ModelTokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    free = post(api, GENERATE, {"token_ids": prompt, "output_mode": "text",
                                "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}).json()
    text = free["choices"][0]["text"]
    assert free["output_mode"] == "text" and text == tokenizer.decode(free["choices"][0]["token_ids"])
    stop = text[4:6]
    cut = post(api, GENERATE, {"token_ids": prompt, "output_mode": "text", "sampling_params": {
        "temperature": 0, "max_tokens": 12, "ignore_eos": True, "stop": [stop]}}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:text.index(stop)], "the stop string is left out, as vLLM leaves it"


def test_the_x_request_id_header_names_the_request(api: Hosted) -> None:
    answer = post(api, GENERATE, {"token_ids": [5, 6], "request_id": "mine", "sampling_params": {"max_tokens": 2}},
                  headers={"X-Request-Id": "traced"})
    assert answer.json()["request_id"] == "generate-tokens-traced"
    assert post(api, GENERATE, {"token_ids": [5, 6], "request_id": "mine", "sampling_params": {"max_tokens": 2}}
                ).json()["request_id"] == "generate-tokens-mine"


@pytest.mark.parametrize("request_id", ["slow", "generate-tokens-slow"])
def test_abort_requests_ends_a_stream_in_flight_and_frees_its_blocks(slow_api: Hosted, request_id: str) -> None:
    api = slow_api
    chunks: list[dict] = []

    def read() -> None:
        body = {"token_ids": [5, 6, 7], "request_id": "slow", "stream": True,
                "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}
        with httpx.stream("POST", f"{api.url}{GENERATE}", json=body, timeout=30) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    answer = post(api, "/inference/v1/abort_requests", {"request_ids": [request_id, "unknown"]})
    reader.join(30)
    assert answer.json() == {"status": "aborted", "aborted": 1}
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 1500
    api.assert_idle()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [5, TOKENIZER_VOCAB_SIZE], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [5]}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"temperature": -1}}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"max_tokens": MAX_MODEL_LEN}}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, 400,
     "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"structured_output": True}}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"thinking_token_budget": 8}}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"detokenize": False}, "output_mode": "text"}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {"prompt_logprobs": 1}, "stream": True}, 400, "sampling_params"),
    ({"token_ids": [5], "sampling_params": {}, "kv_transfer_params": {"do_remote_decode": True}}, 400,
     "kv_transfer_params"),
    ({"token_ids": [5], "sampling_params": {}, "output_mode": "words"}, 400, "output_mode"),
    ({"token_ids": [5], "sampling_params": {}, "model": "other"}, 404, "model"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(api: Hosted, body: dict, status: int,
                                                             param: str) -> None:
    answer = post(api, GENERATE, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    refused = post(api, "/inference/v1/abort_requests", {"request_ids": 5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_ids"


def test_logprobs_list_the_sampled_token_first_as_vllm_does(model_api: Hosted) -> None:
    prompt = model_api.openai().completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=1, extra_body={"return_token_ids": True},
        logprobs=0).choices[0].prompt_token_ids
    greedy = model_api.openai().completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                   extra_body={"return_token_ids": True}).choices[0]
    answer = post(model_api, GENERATE, {"token_ids": prompt, "sampling_params": {
        "temperature": 0, "max_tokens": 6, "logprobs": 3, "prompt_logprobs": 1}}).json()
    (choice,) = answer["choices"]
    assert choice["token_ids"] == greedy.token_ids
    for token_id, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        assert entry["token_id"] == token_id and entry["rank"] == 1, "greedy: the most likely token"
        top = entry["top_logprobs"]
        assert [c["token_id"] for c in top][0] == token_id and [c["rank"] for c in top] == [1, 2, 3]
        assert entry["logprob"] == top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    assert answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) == len(prompt)
    assert str(prompt[1]) in answer["prompt_logprobs"][1]
    sampled = post(model_api, GENERATE, {"token_ids": prompt, "output_mode": "text", "sampling_params": {
        "temperature": 1.0, "seed": 3, "max_tokens": 8, "logprobs": 1}}).json()["choices"][0]
    for entry in sampled["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 1 and entry["top_logprobs"][0]["token"] == entry["token"]
    model_api.assert_idle()


def test_a_rendered_chat_with_a_constraint_generates_within_it(model_api: Hosted) -> None:
    choices = ["Paris", "Lyon", "Marseille"]
    rendered = post(model_api, "/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Name a city in France."}], "temperature": 1.0, "seed": 11,
        "max_tokens": 8, "structured_outputs": {"choice": choices}}).json()
    assert rendered["sampling_params"]["structured_outputs"] == {"choice": choices}
    answer = post(model_api, GENERATE, {"token_ids": rendered["token_ids"], "output_mode": "text",
                                        "sampling_params": rendered["sampling_params"]}).json()
    assert answer["choices"][0]["text"] in choices
    allowed = rendered["token_ids"][-12:]
    limited = post(model_api, "/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Name a city in France."}], "temperature": 1.0, "seed": 5,
        "max_tokens": 6, "allowed_token_ids": allowed}).json()
    tokens = post(model_api, GENERATE, {"token_ids": limited["token_ids"], "sampling_params": limited[
        "sampling_params"]}).json()["choices"][0]["token_ids"]
    assert tokens and set(tokens) <= set(allowed), "the render's allowed_token_ids reach the generate request"
    model_api.assert_idle()


@pytest.mark.parametrize("constraint", [
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"regex": "[a-z]+"},
    {"choice": ["yes", "no"]}, {"grammar": 'start: "a"+'}, {"json_object": True}])
def test_a_rendered_constraint_comes_back_as_it_was_sent(constraint: dict) -> None:
    served = translate.Served.of(("m",), frozenset())
    body = GenerateRequest(token_ids=[5], sampling_params={"structured_outputs": constraint}, reasoning_ended=True)
    request = inputs.generate_request(body, served, None, 1).requests[0]
    assert gateway.structured_outputs(request) == constraint
    assert request.structured_output.from_first_token, "reasoning_ended: the constraint holds from the first token"
    later = inputs.generate_request(body.model_copy(update={"reasoning_ended": None}), served, None, 1).requests[0]
    assert not later.structured_output.from_first_token


def test_a_request_may_raise_the_stream_interval_but_not_lower_it() -> None:
    served = translate.Served.of(("m",), frozenset())
    for asked, server, used in ((2, 8, 8), (16, 8, 16)):
        body = GenerateRequest(token_ids=[5], sampling_params={"stream_interval": asked})
        assert inputs.generate_request(body, served, None, server).requests[0].stream_interval == used
