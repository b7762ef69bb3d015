"""The OpenAI API, driven by the real ``openai`` SDK (sync and async, streamed and not), against an in-process
scheduler: the same answers as gRPC, n choices, lists of prompts, logprobs, stop strings, seeds, usage,
structured output forwarded, and errors as the SDK's exceptions with the right ``param``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.http.cors import Cors
from scheduler_svc.config import parse_config
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.tokenizer import ChatMessage
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import TOKENIZER_VOCAB_SIZE, GatedExecutor
from tests.test_service_loop import LogprobExecutor
from tests.test_service_options import TOKENIZER, TOKENIZER_JSON, echo

MODEL = "echo"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def echo_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    """The echo executor (completion token i is prompt token i mod its length) with made-up logprobs; the routes
    served by the API process (the default) and by the scheduler's own process (``--api-process off``)."""
    with hosted(LogprobExecutor(echo()), api_process=request.param) as h:
        yield h


@pytest.fixture
def api(echo_api: Hosted) -> Iterator[Hosted]:
    yield echo_api
    echo_api.assert_idle()


def grpc_chat(api: Hosted, max_tokens: int) -> pb.GenerateResponse:
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    return api.stub.GenerateOnce(pb.GenerateRequest(chat=chat, stopping=pb.StoppingOptions(max_tokens=max_tokens)))


def test_a_chat_completion_is_what_grpc_answers(api: Hosted):
    reply = api.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, user="someone",
                                                 extra_body={"return_token_ids": True, "not_a_parameter": 1})
    expected = grpc_chat(api, 12)
    choice = reply.choices[0]
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", expected.text)
    assert choice.token_ids == list(expected.token_ids) and choice.finish_reason == "length"
    assert reply.object == "chat.completion" and reply.model == MODEL and reply.id.startswith("chatcmpl-")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        expected.usage.prompt_tokens, 12, expected.usage.prompt_tokens + 12)


def test_a_streamed_chat_sends_the_role_then_the_content_then_the_usage(api: Hosted):
    client = api.openai()
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=1)  # both then hit the cache
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_a_completion_echoes_its_prompt_when_asked(api: Hosted):
    client = api.openai()
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6)
    echoed = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, echo=True)
    expected = api.stub.GenerateOnce(pb.GenerateRequest(text="Hello world", stopping=pb.StoppingOptions(max_tokens=6)))
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    assert plain.choices[0].text == expected.text and echoed.choices[0].text == "Hello world" + expected.text
    streamed = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, echo=True,
                                              stream=True))
    assert streamed[0].choices[0].text == "Hello world"
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_the_async_client_streams_and_waits_alike(api: Hosted):
    async def run() -> tuple[str, str, list[str]]:
        async with api.async_openai() as client:
            whole = await client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=9)
            stream = await client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=9,
                                                     stream=True)
            pieces = [chunk async for chunk in stream]
            chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True)
            deltas = [chunk.choices[0].delta.content or "" async for chunk in chat]
        return whole.choices[0].text, "".join(c.choices[0].text for c in pieces), deltas

    whole, streamed, deltas = asyncio.run(run())
    assert streamed == whole and whole
    assert "".join(deltas) == grpc_chat(api, 5).text


def test_n_choices_are_indexed_and_the_prompt_counts_once(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3)
    prompt_tokens = len(TOKENIZER.encode_chat([ChatMessage(**m) for m in MESSAGES]))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3, stream=True))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert text == reply.choices[i].message.content


def test_a_list_of_prompts_is_one_request_each_with_choices_in_order(api: Hosted):
    client = api.openai()
    prompts = ["Hello world", "The quick brown fox"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, echo=True)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(reply.choices, [prompts[0]] * 2 + [prompts[1]] * 2,
                                                  strict=True)] == [True] * 4
    prompt_tokens = sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    ids = [TOKENIZER.encode(p, add_special_tokens=False) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, extra_body={"return_token_ids": True})
    one = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, extra_body={"return_token_ids": True})
    assert [c.token_ids for c in by_ids.choices] == [i[:3] for i in ids] and one.choices[0].token_ids == ids[1][:3]
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, stream=True))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_chat_logprobs_come_in_the_chat_format(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                           top_logprobs=1, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    tokens = [TOKENIZER.decode([t], skip_special_tokens=False) for t in choice.token_ids]
    assert [e.token for e in choice.logprobs.content] == tokens
    for entry in choice.logprobs.content:
        assert entry.logprob == -0.25 and entry.bytes == list(entry.token.encode())
        assert [(top.token, top.logprob) for top in entry.top_logprobs] == [(entry.token, -0.25)]
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], []]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                                 top_logprobs=1, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in choice.logprobs.content]
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_come_in_the_legacy_format(api: Hosted):
    reply = api.openai().completions.create(model=MODEL, prompt="Hello world", max_tokens=4, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.token_logprobs == [-0.25] * 4
    one = TOKENIZER.decode([1], skip_special_tokens=False)
    assert lp.top_logprobs == [{token: -0.25, one: -2.0} for token in lp.tokens]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_logprobs_name_their_tokens_by_id_where_the_request_asks(api: Hosted):
    client = api.openai()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=1,
                                          extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = chat.choices[0]
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in choice.token_ids]
    for token_id, e in zip(choice.token_ids, choice.logprobs.content, strict=True):
        assert e.bytes == list(TOKENIZER.decode([token_id], skip_special_tokens=False).encode()), "its own bytes"
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].bytes == list(e.token.encode())
    assert choice.message.content == TOKENIZER.decode(choice.token_ids), "only the logprobs change, not the text"
    text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True,
                                                 "return_token_ids": True}).choices[0]
    assert text.logprobs.tokens == [f"token_id:{t}" for t in text.token_ids]
    assert text.logprobs.top_logprobs == [{token: -0.25} for token in text.logprobs.tokens]


def test_the_server_flag_names_tokens_by_id_unless_a_request_says_otherwise():
    with hosted(LogprobExecutor(echo()), return_tokens_as_token_ids=True) as h:
        client = h.openai()
        by_id = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logprobs=0,
                                          extra_body={"return_token_ids": True}).choices[0]
        assert by_id.logprobs.tokens == [f"token_id:{t}" for t in by_id.token_ids]
        named = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logprobs=0,
                                          extra_body={"return_tokens_as_token_ids": False}).choices[0]
        assert "".join(named.logprobs.tokens) == named.text
        generated = httpx.post(f"{h.url}/inference/v1/generate", timeout=10, json={
            "token_ids": TOKENIZER.encode("Hello"), "output_mode": "text",
            "sampling_params": {"max_tokens": 2, "logprobs": 0}}).json()["choices"][0]
        assert [e["token"] for e in generated["logprobs"]["content"]] == [
            f"token_id:{t}" for t in generated["token_ids"]], "the generate route's text mode too, as vLLM's"
        batch = httpx.post(f"{h.url}/v1/chat/completions/batch", timeout=10, json={
            "messages": [MESSAGES, MESSAGES[1:]], "max_tokens": 2, "logprobs": True, "return_token_ids": True})
        for choice in batch.json()["choices"]:
            assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
        response = httpx.post(f"{h.url}/v1/responses", timeout=10, json={
            "model": MODEL, "input": "Hello", "max_output_tokens": 2, "include": ["message.output_text.logprobs"]})
        (text,) = response.json()["output"][0]["content"]
        assert text["logprobs"] and all(e["token"].startswith("token_id:") for e in text["logprobs"])
        h.assert_idle()


def test_stop_strings_end_the_text_before_them(api: Hosted):
    client = api.openai()
    reply = client.completions.create(model=MODEL, prompt="say STOP now", max_tokens=20, stop="STOP")
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("say ", "stop")
    kept = client.completions.create(model=MODEL, prompt="say STOP now", max_tokens=20, stop=["now", "STOP"],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == "say STOP"


def test_a_seed_reproduces_the_tokens_choice_by_choice():
    executor = ShadowExecutor(num_blocks=128, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE,
                              tokenizer_json=TOKENIZER_JSON)
    with hosted(executor) as h:
        client = h.openai()

        def tokens(seed: int) -> list[list[int]]:
            reply = client.completions.create(model="shadow-kv", prompt=[5, 6, 7], max_tokens=8, n=2, seed=seed,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
            return [c.token_ids for c in reply.choices]

        first, again, other = tokens(7), tokens(7), tokens(8)
        h.assert_idle()
    params = SamplingParams(seed=7, n=2)
    assert first == again == [reference_generate([5, 6, 7], 8, TOKENIZER_VOCAB_SIZE, {0}, True,
                                                 params.for_choice(i).seed) for i in range(2)]
    assert other != first


CHAT_ERRORS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto" needs the flags
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop": "x", "extra_body": {"use_beam_search": True}}, "stop"),
    ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ({"extra_body": {"continue_final_message": True, "add_generation_prompt": True}}, "continue_final_message"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
]
COMPLETION_ERRORS = [
    ({"prompt": [1] * 300}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, TOKENIZER_VOCAB_SIZE]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"extra_body": {"min_tokens": 50}}, "min_tokens"),
    ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ({"extra_body": {"truncate_prompt_tokens": -2}}, "truncate_prompt_tokens"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"allowed_token_ids": [1, TOKENIZER_VOCAB_SIZE]}}, "allowed_token_ids"),
    ({"extra_body": {"bad_words": [" "]}}, "bad_words"),
    ({"extra_body": {"truncation_side": "middle"}}, "truncation_side"),
    ({"extra_body": {"kv_transfer_params": {}}}, "kv_transfer_params"),
    ({"extra_body": {"guided_regex": "[ab]+"}}, "guided_regex"),
]


@pytest.mark.parametrize(("options", "param"), CHAT_ERRORS)
def test_bad_chat_input_is_a_bad_request_naming_the_parameter(api: Hosted, options: dict, param: str):
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **options}
    with pytest.raises(openai.BadRequestError) as refused:
        api.openai().chat.completions.create(**request)
    assert (refused.value.status_code, refused.value.param, refused.value.type) == (400, param,
                                                                                   "invalid_request_error")
    assert refused.value.body["message"].startswith(param)


@pytest.mark.parametrize(("options", "param"), COMPLETION_ERRORS)
def test_bad_completion_input_is_a_bad_request_naming_the_parameter(api: Hosted, options: dict, param: str):
    with pytest.raises(openai.BadRequestError) as refused:
        api.openai().completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 4, **options})
    assert (refused.value.status_code, refused.value.param) == (400, param)


def test_truncate_prompt_tokens_minus_one_keeps_the_whole_prompt_as_vllm_reads_it(api: Hosted):
    whole, cut = (api.openai().completions.create(model=MODEL, prompt=list(range(5, 45)), max_tokens=1, echo=True,
                                                  extra_body={"truncate_prompt_tokens": n}) for n in (-1, 8))
    assert (whole.usage.prompt_tokens, cut.usage.prompt_tokens) == (40, 8)
    prompt = [5 + i % 250 for i in range(300)]
    too_long = api.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                               extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True})
    assert too_long.choices[0].prompt_token_ids == prompt[-255:], "cut to the model's length less one, as vLLM's"


@pytest.mark.parametrize(("side", "kept"), [(None, list(range(37, 45))), ("left", list(range(37, 45))),
                                            ("right", list(range(5, 13)))])
def test_truncation_side_right_keeps_the_prompts_first_tokens_as_vllms(api: Hosted, side: str | None, kept: list):
    extra = {"truncate_prompt_tokens": 8, "return_token_ids": True, "truncation_side": side}
    completion = api.openai().completions.create(model=MODEL, prompt=list(range(5, 45)), max_tokens=1, extra_body=extra)
    chat = api.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra)
    assert completion.choices[0].prompt_token_ids == kept
    whole = api.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                 extra_body={"return_token_ids": True})
    rendered = whole.prompt_token_ids
    assert chat.prompt_token_ids == (rendered[:8] if side == "right" else rendered[-8:])


def test_vllms_parameters_at_their_defaults_are_accepted(api: Hosted):
    # Refused only when they would change the answer: at vLLM's defaults they change nothing.
    defaults = {"use_beam_search": False, "allowed_token_ids": None, "bad_words": [], "truncation_side": "left",
                "continue_final_message": False, "chat_template": None, "prompt_logprobs": None}
    reply = api.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=defaults)
    assert reply.choices[0].finish_reason == "length"


def test_an_unknown_model_is_not_found(api: Hosted):
    client = api.openai()
    for call in (lambda: client.chat.completions.create(model="gpt-4o", messages=MESSAGES),
                 lambda: client.completions.create(model="gpt-4o", prompt="Hi"),
                 lambda: client.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert (missing.value.param, missing.value.code) == ("model", "model_not_found")
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 256


def test_the_api_key_is_required_on_the_openai_routes_not_on_health():
    with hosted(echo(), api_key="s3cret") as h:
        with pytest.raises(openai.AuthenticationError) as refused:
            h.openai(api_key="wrong").models.list()
        assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")
        reply = h.openai(api_key="s3cret").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert httpx.get(f"{h.url}/health").status_code == 200
        unauthenticated = httpx.post(f"{h.url}/v1/completions", content=b"not even JSON")
        assert unauthenticated.status_code == 401 and unauthenticated.json()["error"]["code"] == "invalid_api_key"
        h.assert_idle()


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_a_browser_page_of_another_origin_may_call_as_the_cors_flags_say(api_process: bool):
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with hosted(echo(), api_key="s3cret", api_process=api_process) as h:
        allowed = httpx.options(f"{h.url}/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200, "a preflight carries no API key: vLLM's defaults let any origin call"
        assert allowed.headers["access-control-allow-origin"] == "*"
        refused = httpx.post(f"{h.url}/v1/completions", json={"prompt": "Hi"}, headers={"origin": "https://ui.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*", \
            "the page can read why it was refused"
        answered = httpx.post(f"{h.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                              headers={"origin": "https://ui.example", "authorization": "Bearer s3cret"})
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"
        assert len(answered.headers.get_list("access-control-allow-origin")) == 1, "one app in front answers"
    with hosted(echo(), allowed_origins=("https://ui.example",), api_process=api_process) as h:
        assert httpx.options(f"{h.url}/v1/completions", headers=preflight).status_code == 200
        other = httpx.options(f"{h.url}/v1/completions", headers={**preflight, "origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        h.assert_idle()


def test_the_cors_flags_take_json_lists_as_vllm_does(capsys: pytest.CaptureFixture[str]):
    config = parse_config(["--allowed-origins", '["https://ui.example"]', "--allowed-credentials", "on"], {})
    assert config.cors() == Cors(("https://ui.example",), True, ("*",), ("*",))
    with pytest.raises(SystemExit):
        parse_config([], {"NANOSERVE_ALLOWED_METHODS": "GET"})
    assert "NANOSERVE_ALLOWED_METHODS='GET': must be a JSON list of strings" in capsys.readouterr().err


def test_top_k_and_seed_minus_one_mean_none_as_vllm_reads_them(api: Hosted, seen: list[pb.GenerateRequest]):
    api.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=-1, extra_body={"top_k": -1})
    api.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=-2)
    off, twin = (request.sampling for request in seen)
    assert off.HasField("top_k") and off.top_k == 0, "no top-k, not the model's generation_config default"
    assert not off.HasField("seed"), "-1: a random seed each time, as vLLM's SamplingParams reads it"
    assert twin.seed == 2**64 - 2


def test_structured_output_reaches_the_generate_request(api: Hosted, seen: list[pb.GenerateRequest]):
    client = api.openai()
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                   response_format={"type": "json_object"})
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    for extra in ({"structured_outputs": {"regex": "a+"}}, {"response_format": {"type": "text"}}):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    constraints = [r.structured_output for r in seen]
    assert json.loads(constraints[0].json_schema) == schema and constraints[1].json_object
    assert list(constraints[2].choice.choices) == ["yes", "no"] and constraints[3].regex == "a+"
    assert not seen[4].HasField("structured_output")


def test_a_full_queue_is_a_rate_limit_error():
    executor = GatedExecutor(echo(), steps_before_closing=1)

    async def run() -> openai.RateLimitError:
        async with h.async_openai() as client:
            first = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=50, stream=True,
                                                    extra_body={"ignore_eos": True})
            await anext(aiter(first))  # its first step ran; the loop is now held inside the second
            queued = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="Hello", max_tokens=2))
            while h.server.loop.admission.num_requests < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
            executor.open.set()
            assert (await queued).usage.completion_tokens == 2
            assert [chunk async for chunk in first][-1].choices[0].finish_reason == "length"
            return refused.value

    with hosted(executor, max_num_seqs=1, max_queued_requests=1) as h:
        refused = asyncio.run(run())
        h.assert_idle()
    assert (refused.status_code, refused.code) == (429, "rate_limit_exceeded")


def test_a_stream_interval_sends_fewer_larger_chunks_of_the_same_text():
    with hosted(echo(), stream_interval=4) as gathered:
        client = gathered.openai()
        whole = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=9)
        chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=9, stream=True))
        gathered.assert_idle()
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == whole.choices[0].text and whole.usage.completion_tokens == 9
    # Nine tokens: the first alone, then runs of at least four (one chunk each without the interval).
    assert len(texts) <= 4


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_a_requests_stream_interval_raises_the_servers_and_never_lowers_it(api_process: bool):
    with hosted(echo(), stream_interval=2, api_process=api_process) as api:
        client = api.openai()

        def chunks(asked: int) -> list[int]:
            """Tokens per chunk of a streamed 13-token completion that asked for ``asked``."""
            stream = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=13, stream=True,
                                               extra_body={"stream_interval": asked, "return_token_ids": True})
            return [len(chunk.choices[0].token_ids) for chunk in stream if chunk.choices]

        raised = chunks(4)
        assert sum(raised) == 13 and all(n >= 4 for n in raised[1:-1]) and max(raised) >= 4
        assert all(n >= 2 for n in chunks(1)[1:-1]), "1 is below the server's 2: the server's holds"
        refused = httpx.post(f"{api.url}/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "x"}], "stream_interval": 0})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_interval"
        api.assert_idle()
