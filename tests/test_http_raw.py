"""The HTTP API below the SDK (httpx): SSE framing, a client that goes away, 503 before the executor answers and
while draining, tokenize and detokenize, errors for any route, TLS and mutual TLS, and the status tables."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from common.step import StepPlan, StepResult, TokenLogprobs
from executor_svc.core.request_table import RequestTable
from executor_svc.fakes.shadow import ShadowExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api import grpc_service as service
from scheduler_svc.api import grpc_status
from scheduler_svc.api.http import errors
from scheduler_svc.api.http.translate import openai_param
from scheduler_svc.config import ServiceConfig
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.tokenizer import ChatMessage
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import HOST, GatedExecutor, free_port
from tests.shadow_helpers import shadow_prompt_logprobs
from tests.test_reliability_recovery import FlakyExecutor
from tests.test_service_loop import LogprobExecutor
from tests.test_service_options import TOKENIZER, echo

MODEL = "echo"
# A step this long leaves time to count the steps between a client leaving and its blocks coming free.
STEP_S = 0.01


class SlowExecutor(GatedExecutor):
    def step(self, plan: StepPlan) -> StepResult:
        time.sleep(STEP_S)
        return super().step(plan)


@pytest.fixture(scope="module")
def slow_api() -> Iterator[Hosted]:
    with hosted(SlowExecutor(ShadowExecutor(num_blocks=1024, block_size=4, vocab_size=50))) as h:
        yield h


@pytest.fixture(scope="module")
def echo_api() -> Iterator[Hosted]:
    with hosted(echo()) as h:
        yield h


def events(body: str) -> list[str]:
    """The SSE events of a body, checking its framing: ``data: <payload>`` each, separated by a blank line."""
    assert body.endswith("\n\n")
    lines = body[:-2].split("\n\n")
    assert all(line.startswith("data: ") and "\n" not in line for line in lines), body
    return [line.removeprefix("data: ") for line in lines]


def test_a_stream_is_data_lines_ending_with_done(echo_api: Hosted):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 6,
               "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{echo_api.url}/v1/chat/completions", json=request)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(response.text)
    assert done == "[DONE]"
    chunks = [json.loads(chunk) for chunk in chunks]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    completion = httpx.post(f"{echo_api.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True,
                                                                   "max_tokens": 3})
    *chunks, done = events(completion.text)
    assert done == "[DONE]" and {json.loads(c)["object"] for c in chunks} == {"text_completion"}
    echo_api.assert_idle()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(echo_api: Hosted, path: str):
    prompt = {"messages": [{"role": "user", "content": "Hello world"}]} if "chat" in path else {"prompt": "Hello"}
    request = {**prompt, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, done = events(httpx.post(f"{echo_api.url}{path}", json=request).text)
    chunks = [json.loads(chunk) for chunk in chunks]
    final = chunks.pop()["usage"]
    assert done == "[DONE]" and all("usage" in chunk for chunk in chunks)
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        assert chunk["usage"]["prompt_tokens"] == final["prompt_tokens"]
        assert chunk["usage"]["total_tokens"] == final["prompt_tokens"] + chunk["usage"]["completion_tokens"]
        so_far[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
    assert all(counts == sorted(counts) and counts[-1] == 5 for counts in so_far.values()), so_far
    assert final["completion_tokens"] == 10
    without = httpx.post(f"{echo_api.url}{path}", json={**request, "stream_options": {"include_usage": True}}).text
    assert sum('"usage"' in event for event in events(without)) == 1, "only the last chunk, as before"
    echo_api.assert_idle()


def test_streamed_chunks_are_not_held_back_on_a_kept_alive_connection(echo_api: Hosted):
    """Nagle off: with it on, each first chunk after a connection's first response waited ~40 ms for an ACK."""
    request = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": True}
    waits = []
    with httpx.Client(base_url=echo_api.url) as client:
        for _ in range(9):
            start = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=request) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                waits.append(time.perf_counter() - start)
                assert [line for line in lines if line][-1] == "data: [DONE]"
    assert sorted(waits)[len(waits) // 2] < 0.02, waits
    echo_api.assert_idle()


def wait_stats(api: Hosted, idle: bool, timeout_s: float = 5.0) -> pb.SchedulerStats:
    """GetStats over gRPC until no request runs and every block is free (``idle``), or one request runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
        free = stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
        if free if idle else stats.num_running == 1:
            return stats
        assert time.monotonic() < deadline, f"still {'busy' if idle else 'not running'}: {stats}"
        time.sleep(STEP_S / 2)


LONG = {"model": "shadow-kv", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "return_token_ids": True}


# Steps the request may run after its client left: the event loop sees the disconnect, then the engine loop cancels
# between steps; one or two on an idle machine, once three on the 2-core VM in a slow spell with the suite on two
# workers. Missed, the request would run its 4,000.
STEPS_AFTER_LEAVING = 10


def test_a_client_leaving_mid_stream_frees_its_blocks_within_a_few_steps(slow_api: Hosted):
    before = slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    with httpx.stream("POST", f"{slow_api.url}/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line).removeprefix("data: "))
        assert first["choices"][0]["token_ids"]
        running = wait_stats(slow_api, idle=False)
        assert running.num_free_blocks < running.num_blocks
    left = slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    idle = wait_stats(slow_api, idle=True)
    assert idle.num_steps - left.num_steps <= STEPS_AFTER_LEAVING, "the request ran on after its client left"
    assert idle.num_aborted == before.num_aborted + 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_before_any_answer_frees_its_blocks(slow_api: Hosted, stream: bool):
    before = slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    body = json.dumps({**LONG, "stream": stream}).encode()
    with socket.create_connection((HOST, int(slow_api.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: nanoserve\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 5
    while slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5).num_aborted == before.num_aborted:
        assert time.monotonic() < deadline, "the request of a client that left was never aborted"
        time.sleep(STEP_S)
    wait_stats(slow_api, idle=True)


def test_a_client_leaving_a_whole_response_frees_its_blocks(slow_api: Hosted):
    before = slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_api.url}/v1/completions", json=LONG, timeout=httpx.Timeout(5, read=0.3))
    left = slow_api.stub.GetStats(pb.GetStatsRequest(), timeout=5)
    idle = wait_stats(slow_api, idle=True)
    assert idle.num_steps - left.num_steps <= 2 and idle.num_aborted == before.num_aborted + 1


def test_a_grpc_abort_ends_an_http_stream_by_its_id(slow_api: Hosted):
    with httpx.stream("POST", f"{slow_api.url}/v1/completions", json={**LONG, "stream": True}) as response:
        lines = (line for line in response.iter_lines() if line)
        response_id = json.loads(next(lines).removeprefix("data: "))["id"]
        aborted = slow_api.stub.Abort(pb.AbortRequest(request_ids=[response_id]), timeout=5)
        rest = list(lines)
    assert list(aborted.aborted_request_ids) == [response_id]
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert rest[-1] == "data: [DONE]"
    wait_stats(slow_api, idle=True)


def test_503_until_the_executor_answers_and_while_draining():
    executor = GatedExecutor(echo(), steps_before_closing=1)
    port = free_port()
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}

    async def run() -> None:
        server = service.SchedulerServer(ServiceConfig(host=HOST, port=0, http_port=port, shutdown_grace=30),
                                         executor)
        await server.start()
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}") as client:
            assert (await client.get("/health")).status_code == 503
            early = await client.post("/v1/completions", json=completion)
            assert early.status_code == 503 and early.json()["error"]["code"] == "service_unavailable"
            assert "still connecting" in early.json()["error"]["message"]
            assert (await client.get("/v1/models")).status_code == 503
            assert await server.connect()
            assert (await client.get("/health")).status_code == 200
            long = {**completion, "max_tokens": 50, "stream": True}
            async with client.stream("POST", "/v1/completions", json=long) as in_flight:
                lines = in_flight.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                stopping = asyncio.ensure_future(server.stop())
                while not server.loop.admission.closed:
                    await asyncio.sleep(0.01)
                assert (await client.get("/health")).status_code == 503
                refused = await client.post("/v1/completions", json=completion)
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
                executor.open.set()
                assert [line async for line in lines if line][-1] == "data: [DONE]", "the drain cut a request"
            await stopping

    asyncio.run(run())


def test_echo_with_logprobs_scores_the_prompt_as_vllm_does():
    # lm-evaluation-harness's loglikelihood: the prompt echoed with each of its tokens' logprobs (the first has none),
    # then the completion's, whole or streamed.
    prompt, vocab = [3, 9, 4, 7], 50
    with hosted(LogprobExecutor(ShadowExecutor(num_blocks=64, block_size=4, vocab_size=vocab))) as h:
        model = httpx.get(f"{h.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
                "ignore_eos": True}
        whole = httpx.post(f"{h.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
        streamed = httpx.post(f"{h.url}/v1/completions", json={**body, "stream": True}, timeout=30).text
        pair = httpx.post(f"{h.url}/v1/completions", json={**body, "n": 2}, timeout=30).json()["choices"]
        scoring = {**body, "max_tokens": 0}  # vLLM's prompt scoring: the prompt alone, with its logprobs
        alone = httpx.post(f"{h.url}/v1/completions", json=scoring, timeout=30).json()["choices"][0]
        alone_streamed = httpx.post(f"{h.url}/v1/completions", json={**scoring, "stream": True}, timeout=30).text
        refused = httpx.post(f"{h.url}/v1/completions", json={**scoring, "echo": False}, timeout=30)
        h.assert_idle()
    assert alone["logprobs"]["token_logprobs"] == whole["token_logprobs"][:4], "the prompt's, not the token generated"
    assert alone["logprobs"]["tokens"] == whole["tokens"][:4] and alone["finish_reason"] == "length"
    streamed_alone = [choice for e in events(alone_streamed) if e != "[DONE]" for choice in json.loads(e)["choices"]]
    assert [t for choice in streamed_alone if choice.get("logprobs") for t in choice["logprobs"]["tokens"]] == \
        whole["tokens"][:4]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens", "0 without echo"
    scored = shadow_prompt_logprobs(prompt, vocab, 2)
    assert whole["tokens"][:4] == [f"token_id:{t}" for t in prompt] and len(whole["tokens"]) == 4 + 3
    assert whole["token_logprobs"][0] is None and whole["top_logprobs"][0] is None
    assert whole["token_logprobs"][1:4] == pytest.approx([logprob for logprob, _ in scored])
    assert [list(top) for top in whole["top_logprobs"][1:4]] == [[f"token_id:{t}" for t in ids] for _, ids in scored]
    assert whole["token_logprobs"][4:] == [-0.25] * 3, "the completion's own (LogprobExecutor's) follow"
    assert [choice["logprobs"]["token_logprobs"][:4] for choice in pair] == [whole["token_logprobs"][:4]] * 2
    chunks = [json.loads(e)["choices"] for e in events(streamed) if e != "[DONE]"]
    joined = {key: [v for c in chunks for choice in c if choice.get("logprobs") for v in choice["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs")}
    assert joined == {key: whole[key] for key in joined}


def test_tokenize_and_detokenize_speak_vllms_shapes(echo_api: Hosted):
    url = echo_api.url
    text = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert text == {"count": len(TOKENIZER.encode("Hello world")), "max_model_len": 256,
                    "tokens": TOKENIZER.encode("Hello world")}
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == TOKENIZER.encode_chat([ChatMessage("user", "hi")])
    assert httpx.post(f"{url}/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello world"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10_000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    thinking_off = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    hi = [ChatMessage("user", "hi")]
    assert thinking_off["tokens"] == TOKENIZER.encode_chat(hi, True, {"enable_thinking": False}) != chat["tokens"]
    taken = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "chat_template_kwargs"
    neither = httpx.post(f"{url}/tokenize", json={})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    assert httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_vllm_defaults_nulls_a_left_out_model_and_the_stop_reason(echo_api: Hosted):
    url = echo_api.url
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "ignore_eos": True, "stream": None,
                                                      "echo": None, "return_token_ids": None, "logprobs": None})
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["model"] == MODEL, "no model: the base model, as vLLM serves it"
    assert body["usage"]["completion_tokens"] == 16, "a completion's max_tokens left out is OpenAI's and vLLM's 16"
    assert body["choices"][0]["stop_reason"] is None and "token_ids" not in body["choices"][0]
    stopped = httpx.post(f"{url}/v1/completions", json={"prompt": "ab STOP cd", "stop": ["STOP"], "max_tokens": 20})
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    assert stopped.json()["choices"][0]["stop_reason"] == "STOP"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": None, "top_logprobs": 0,
            "stream": None, "seed": -1}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["logprobs"] is None
    refused = httpx.post(f"{url}/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"
    echo_api.assert_idle()


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-scheduler"])
def test_a_failure_after_the_stream_started_is_an_error_event_before_done(api_process: bool):
    executor = FlakyExecutor()
    executor.refuse_decodes = True  # the prefill's first token goes out; the scheduler gives up after three decodes
    with hosted(executor, api_process=api_process) as api:
        request = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{api.url}/v1/completions", json=request, timeout=30) as response:
            assert response.status_code == 200
            *chunks, error, done = [line for line in response.iter_lines() if line.startswith("data: ")]
        executor.refuse_decodes = False
        assert done == "data: [DONE]" and chunks, "tokens first (a recompute brings one more), then the error"
        assert all(json.loads(chunk.removeprefix("data: "))["choices"][0]["finish_reason"] is None for chunk in chunks)
        body = json.loads(error.removeprefix("data: "))["error"]
        assert body["type"] == "server_error" and "keeps failing" in body["message"]
        api.assert_idle()


class BannedLogprobExecutor(LogprobExecutor):
    """Logprobs as a grammar leaves them: the tokens it bans at -inf."""

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        result.logprobs = [TokenLogprobs(lp.logprob, [*lp.top_token_ids, 7], [*lp.top_logprobs, float("-inf")])
                           for lp in result.logprobs]
        return result


def test_a_banned_tokens_logprob_is_vllms_lowest_float_not_null():
    with hosted(BannedLogprobExecutor(echo())) as api:
        chat = httpx.post(f"{api.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3})
        tops = [entry["logprob"] for token in chat.json()["choices"][0]["logprobs"]["content"]
                for entry in token["top_logprobs"]]
        legacy = httpx.post(f"{api.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 3})
        alternatives = [p for top in legacy.json()["choices"][0]["logprobs"]["top_logprobs"] for p in top.values()]
        assert tops[2::3] == [-9999.0, -9999.0] and -9999.0 in alternatives and None not in tops + alternatives
        api.assert_idle()


@pytest.mark.parametrize(("num_blocks", "longest"), [(1024, 1024), (100, 401)])
def test_a_chat_completion_without_max_tokens_runs_to_the_room_left(num_blocks: int, longest: int):
    """As vLLM's: the model's length (or the KV cache, where smaller: the last token needs no slot) less the
    conversation, not the gRPC API's default of 256."""
    executor = echo()
    executor.info = replace(executor.info, max_model_len=1024, num_blocks=num_blocks)
    executor.table = RequestTable(num_blocks, 4, executor.info.vocab_size, 1024)
    with hosted(executor) as api:
        answer = httpx.post(f"{api.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}, timeout=60).json()
        usage = answer["usage"]
        assert answer["choices"][0]["finish_reason"] == "length"
        assert usage["completion_tokens"] == longest - usage["prompt_tokens"] > 256
        api.assert_idle()


def test_every_error_is_in_openais_shape(echo_api: Hosted):
    url = echo_api.url
    for response, status in ((httpx.get(f"{url}/v1/nothing-here"), 404), (httpx.get(f"{url}/v1/completions"), 405),
                             (httpx.post(f"{url}/v1/completions", content=b"{oops",
                                         headers={"content-type": "application/json"}), 400),
                             (httpx.post(f"{url}/v1/completions", json={"model": MODEL}), 400)):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL}).json()["error"]["param"] == "prompt"


def test_both_status_tables_cover_every_failure():
    failures = set(RequestFailed.__subclasses__())
    assert set(errors.STATUS_OF) == set(grpc_status.STATUS_OF) == failures


@pytest.mark.parametrize(("field", "renames", "param"), [
    ("sampling.temperature", {}, "temperature"),
    ("stopping.max_tokens", {}, "max_tokens"),
    ("stopping.max_tokens", {"max_tokens": "max_completion_tokens"}, "max_completion_tokens"),
    ("sampling.logprobs", {"logprobs": "top_logprobs"}, "top_logprobs"),
    ("tokens.token_ids", {}, "prompt"),
    ("prompt", {"prompt": "messages"}, "messages"),
    ("chat.messages[2].role", {}, "messages[2].role"),
    ("structured_output.json_schema", {"structured_output": "response_format"}, "response_format"),
])
def test_scheduler_fields_map_to_openai_parameters(field: str, renames: dict[str, str], param: str):
    assert openai_param(field, renames) == param


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_the_http_api_serves_the_grpc_certificate_and_its_client_ca(tmp_path: Path):
    from tests.test_security import make_ca, make_leaf

    ca = make_ca(tmp_path, "ca")
    names = "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    server_cert, server_key = make_leaf(tmp_path, "server", ca, names + "extendedKeyUsage=serverAuth\n")
    client_cert, client_key = make_leaf(tmp_path, "client", ca, "extendedKeyUsage=clientAuth\n")
    with hosted(echo(), tls_cert=server_cert, tls_key=server_key) as h:
        url = h.url.replace("http://", "https://")
        assert httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=str(ca[0]))).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")  # not signed by a CA this client trusts
    with hosted(echo(), tls_cert=server_cert, tls_key=server_key, tls_ca=str(ca[0])) as h:
        url = h.url.replace("http://", "https://")
        verify = ssl.create_default_context(cafile=str(ca[0]))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(f"{url}/health", verify=verify)  # no client certificate
        verify.load_cert_chain(client_cert, client_key)
        reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                           verify=verify)
        assert reply.json()["usage"]["completion_tokens"] == 2
        h.assert_idle()
