"""``--api-process``: the public gRPC port served by a process of its own, which writes the streams.

A caller must not be able to tell: the same tokens, finishes, usage and statuses as the scheduler serving its port
itself; bad input refused with the field to fix while the rest goes on; callers that leave or are aborted free their
blocks; every other method (unary, streaming, health, reflection) passed through with its status; the API key
checked; a drain ends the streams with ABORT and the drained trailer; an API process that dies stops the scheduler.
Its HTTP port answers the completions itself and passes every other route on, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.channels import DRAINED_KEY
from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api import api_http
from scheduler_svc.api.process_link import pack, read_frame, recv_frame
from tests.http_fixtures import hosted
from tests.service_fixtures import (
    HOST,
    api_process_pid,
    assert_idle,
    assert_idle_async,
    executor_argv,
    free_port,
    in_process_scheduler,
    rest_of,
    running_stack,
    token_request,
)
from tests.shadow_helpers import shadow_prompt_logprobs

VOCAB = 50
GENERATE = "/nanoserve.v1.Generation/Generate"


def shadow() -> ShadowExecutor:
    return ShadowExecutor(num_blocks=1024, block_size=4, vocab_size=VOCAB)


def requests() -> list[tuple[str, pb.GenerateRequest]]:
    """What a caller may ask, each with its own id so that both servers' answers compare as they are."""
    plain = token_request([1, 2, 3], 12, ignore_eos=True)
    gathered = token_request([4, 5], 10, ignore_eos=True)
    gathered.stream_interval = 4
    choices = token_request([6, 7, 8], 6, ignore_eos=True)
    choices.sampling.n, choices.sampling.seed = 3, 11
    stopped = token_request([9, 10], 40, stop_token_ids=[reference_generate([9, 10], 40, VOCAB, ignore_eos=True)[5]])
    once = token_request([11, 12], 7, ignore_eos=True)
    cases = [("stream", plain), ("stream", gathered), ("stream", choices), ("stream", stopped), ("once", once)]
    for k, (_, request) in enumerate(cases):
        request.request_id = f"r{k}"
    return cases


async def answers(stub: pb_grpc.GenerationStub) -> list:
    """Each request's answer as a caller reads it: per choice, its tokens, finish and usage; and the first
    response's id (a stream's pieces depend on timing, what they add up to does not)."""
    out = []
    for kind, request in requests():
        responses = ([r async for r in stub.Generate(request)] if kind == "stream"
                     else [await stub.GenerateOnce(request)])
        by_choice: dict[int, list] = {}
        for r in responses:
            choice = by_choice.setdefault(r.index, [[], None, None])
            choice[0] += r.token_ids
            if r.finish_reason:
                choice[1], choice[2] = r.finish_reason, r.usage
        out.append((responses[0].request_id, sorted(by_choice.items())))
        if request.stream_interval > 1:  # at least four at a time but the first and the finish
            lengths = [len(r.token_ids) for r in responses]
            # (the first goes as soon as it is written: alone, or with those a late first write found waiting)
            assert min(lengths[1:-1], default=4) >= 4 and len(lengths) < 10, lengths
    return out


def test_answers_through_the_api_process_are_the_schedulers_own():
    async def run(api_process: bool) -> list:
        async with in_process_scheduler(shadow(), api_process=api_process) as s:
            got = await answers(s.stub)
            await assert_idle_async(s.stub)
            return got

    through = asyncio.run(run(True))
    assert through == asyncio.run(run(False))
    plain_tokens = through[0][1][0][1][0]
    assert plain_tokens == reference_generate([1, 2, 3], 12, VOCAB, ignore_eos=True)
    assert [len(choices) for _, choices in through] == [1, 1, 3, 1, 1]
    assert through[3][1][0][1][1] == pb.FINISH_REASON_STOP


def test_prompt_logprobs_come_with_the_first_response_on_either_path():
    prompt = [3, 8, 1, 4, 4, 9, 2]

    async def run(api_process: bool) -> list[pb.GenerateResponse]:
        request = token_request(prompt, 3, ignore_eos=True)
        request.prompt_logprobs = 2
        async with in_process_scheduler(shadow(), api_process=api_process) as s:
            responses = [r async for r in s.stub.Generate(request)]
            await assert_idle_async(s.stub)
            return responses

    for api_process in (True, False):
        responses = asyncio.run(run(api_process))
        expected = shadow_prompt_logprobs(prompt, VOCAB, 2)
        scored = responses[0].prompt_logprobs
        assert [lp.logprob for lp in scored] == pytest.approx([logprob for logprob, _ in expected])  # float32 here
        assert [[t.token_id for t in lp.top] for lp in scored] == [top for _, top in expected]
        assert [lp.token_id for lp in responses[0].prompt_logprobs] == prompt[1:]
        assert not any(r.prompt_logprobs for r in responses[1:])


def test_bad_requests_name_the_field_and_lose_nothing_in_flight():
    async def run() -> None:
        async with in_process_scheduler(shadow(), api_process=True) as s:
            long = s.stub.Generate(token_request([1, 2], 200, ignore_eos=True))
            first = await long.read()
            errors = []
            try:
                [r async for r in s.stub.Generate(token_request([], 5))]
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details()))
            once = token_request([1], 3)
            once.sampling.n = 2
            try:
                await s.stub.GenerateOnce(once)
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details()))
            raw = grpc.aio.insecure_channel(f"{HOST}:{s.server.port}")
            try:
                [r async for r in raw.unary_stream(GENERATE)(b"\xff\xff\xff")]
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details()))
            for method in ("Tokenize", "Abort"):  # passed on to the scheduler's servicer
                try:
                    await raw.unary_unary(f"/nanoserve.v1.Generation/{method}")(b"\xff\xff\xff")
                except grpc.aio.AioRpcError as e:
                    errors.append((e.code(), e.details()))
            await raw.close()
            deep = token_request([1], 3)  # past the JSON parser's recursion limit: refused, not a lost call
            deep.structured_output.json_schema = '{"a":' * 50_000 + "1" + "}" * 50_000
            try:
                await s.stub.GenerateOnce(deep, timeout=30)
            except grpc.aio.AioRpcError as e:
                errors.append((e.code(), e.details()))
            rest = await rest_of(long)
            tokens = [t for r in [first, *rest] for t in r.token_ids]
            assert tokens == reference_generate([1, 2], 200, VOCAB, ignore_eos=True)
            assert [code for code, _ in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 6, errors
            assert errors[0][1].startswith("tokens.token_ids")
            assert errors[1][1].startswith("sampling.n")
            assert errors[2][1].startswith("not Generate's request message")
            assert errors[3][1].startswith("not Tokenize's request message")
            assert errors[4][1].startswith("not Abort's request message")
            assert errors[5][1].startswith("structured_output.json_schema")
            await assert_idle_async(s.stub)

    asyncio.run(run())


def test_callers_that_leave_or_are_aborted_free_their_blocks():
    async def run() -> None:
        async with in_process_scheduler(shadow(), api_process=True) as s:
            left = s.stub.Generate(token_request([1, 2], 3000, ignore_eos=True))
            await left.read()
            left.cancel()
            aborted_request = token_request([3, 4], 3000, ignore_eos=True)
            aborted_request.request_id = "to-abort"
            aborted = s.stub.Generate(aborted_request)
            await aborted.read()
            answer = await s.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
            rest = await rest_of(aborted)
            assert list(answer.aborted_request_ids) == ["to-abort"]
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            stats = await assert_idle_async(s.stub)
            assert stats.num_aborted == 2

    asyncio.run(run())


def test_every_other_method_passes_through_with_its_status():
    async def run(api_process: bool) -> list:
        async with in_process_scheduler(shadow(), api_process=api_process) as s:
            channel = grpc.aio.insecure_channel(f"{HOST}:{s.server.port}")
            info = await s.stub.GetModelInfo(pb.GetModelInfoRequest())
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            services = sorted([service.name async for answer in reflection
                               for service in answer.list_services_response.service])
            try:
                await s.stub.Tokenize(pb.TokenizeRequest(text="no tokenizer here"))
                refused = None
            except grpc.aio.AioRpcError as e:
                refused = (e.code(), e.details())
            await channel.close()
            return [info.model_id, info.vocab_size, health.status, services, refused]

    through = asyncio.run(run(True))
    assert through == asyncio.run(run(False))
    assert through[2] == health_pb2.HealthCheckResponse.SERVING
    assert "nanoserve.v1.Generation" in through[3]
    assert through[4] is not None


def test_the_api_key_is_checked_on_every_call():
    async def run() -> None:
        async with in_process_scheduler(shadow(), api_process=True, api_key="sesame") as s:
            for call in (lambda md: s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md),
                         lambda md: s.stub.GenerateOnce(token_request([1], 2), metadata=md)):
                try:
                    await call(())
                    raise AssertionError("a call without the key was answered")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                await call((("authorization", "Bearer sesame"),))
            channel = grpc.aio.insecure_channel(f"{HOST}:{s.server.port}")
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await channel.close()

    asyncio.run(run())


def test_a_drain_ends_streams_with_abort_and_the_drained_trailer():
    async def run() -> None:
        async with in_process_scheduler(shadow(), api_process=True, shutdown_grace=0) as s:
            call = s.stub.Generate(token_request([1, 2], 3000, ignore_eos=True))
            await call.read()
            stopping = asyncio.ensure_future(s.server.stop())
            rest = await rest_of(call)
            trailer = dict(await call.trailing_metadata())
            await stopping
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert trailer.get(DRAINED_KEY) == "true"
            assert s.server.api.process.poll() == 0

    asyncio.run(run())


def test_the_scheduler_stops_when_its_api_process_dies(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, {}), tmp_path, executor_port=port, api_process="on") as s:
        response = s.stub.GenerateOnce(token_request([1, 2], 3), timeout=10)
        assert len(response.token_ids) == 3
        assert_idle(s.stub)
        os.kill(api_process_pid(s.scheduler.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while s.scheduler.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.scheduler.returncode == 1
        assert "the API process ended" in s.logs()


def test_ctrl_c_drains_the_stream_in_flight_through_the_api_process(tmp_path: Path):
    """Ctrl-C reaches the scheduler and its API process together (one process group): the API process leaves the
    stop to the scheduler, which lets the stream in flight finish, then both exit cleanly."""
    port = free_port()
    with running_stack(executor_argv("shadow", port, {}), tmp_path, executor_port=port, api_process="on") as s:
        responses = s.stub.Generate(token_request([1, 2, 3], 380, ignore_eos=True))
        first = next(responses)
        api = api_process_pid(s.scheduler.pid)
        for pid in (s.scheduler.pid, api):  # as the terminal sends it: to every process of the group
            os.kill(pid, signal.SIGINT)
        rest = list(responses)
        assert rest, "the stream was still running when Ctrl-C came"
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH, "drained, not aborted"
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 380
        assert s.scheduler.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while alive(api) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(api), "the API process outlived its scheduler"


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting to be reaped is done)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_http_routes_not_answered_here_pass_through_with_status_headers_and_body():
    """Completions are answered by the API process; every other route reaches the scheduler's app unchanged, as
    without it: methods, query strings, bodies, statuses, headers, errors naming the field."""
    answers_of: dict[bool, list] = {}
    for api_process in (True, False):
        with hosted(shadow(), api_process=api_process) as h:
            with httpx.Client(base_url=h.url, timeout=30) as http:
                model = http.get("/v1/models").json()["data"][0]["id"]
                body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                streamed = http.post("/v1/completions", json={**body, "stream": True})
                events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
                tokens = [t for event in events for choice in json.loads(event[6:])["choices"]
                          for t in choice.get("token_ids") or []]
                metrics = http.get("/metrics")
                answers = [
                    tokens,
                    http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"],
                    (streamed.status_code, streamed.headers["content-type"]),
                    http.post("/detokenize", json={"tokens": [1, 2]}).status_code,
                    http.post("/tokenize", json={"model": model}).json()["error"]["param"],
                    http.get(f"/v1/models/{model}").json()["id"],
                    http.get("/v1/models/nope?x=1").status_code,
                    http.get("/v1/completions").status_code,
                    http.get("/no/such/route").status_code,
                    http.get("/health").status_code,
                    (metrics.status_code, metrics.headers["content-type"], "nanoserve" in metrics.text),
                    sorted(http.get("/openapi.json").json()["paths"])[:3],
                ]
            h.assert_idle()
        answers_of[api_process] = answers
    got = answers_of[True]
    assert got[0] == got[1] == reference_generate([1, 2, 3], 5, VOCAB, ignore_eos=True)
    assert got[2:10] == [(200, "text/event-stream; charset=utf-8"), 400, "prompt", got[5], 404, 405, 404, 200]
    assert got[10][0] == 200 and got[10][1].startswith("text/plain") and got[10][2]
    assert got == answers_of[False]


@pytest.mark.parametrize("side", ["event loop", "blocking"])
def test_a_link_whose_other_end_died_with_frames_unread_ends_like_one_closed(side: str):
    """A process killed with frames of ours unread resets the link instead of closing it: each side reads that as
    the end (the API process then ends its streams so that failover clients resume; the scheduler stops)."""
    ours, theirs = socket.socketpair()
    ours.sendall(pack(("reading", 8)))  # never read by the other end
    theirs.close()

    async def on_event_loop():
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            return await read_frame(reader)
        finally:
            writer.close()

    if side == "event loop":
        assert asyncio.run(on_event_loop()) is None
    else:
        assert recv_frame(ours) is None
        ours.close()


def test_http_requests_that_come_while_the_tokenizer_is_built_wait_for_it(monkeypatch: pytest.MonkeyPatch):
    # The API process's HTTP routes decode logprobs and echoes with the handshake's tokenizer: a request that comes
    # while the first one builds it waits, rather than answering token ids for text.
    built = []

    def slow_tokenizer(*args: object) -> str:
        time.sleep(0.2)
        built.append(args)
        return "tokenizer"

    monkeypatch.setattr(api_http, "ModelTokenizer", slow_tokenizer)
    asked: list[bool] = []

    class Link:
        async def ask(self, kind: str, with_tokenizer: bool) -> tuple:
            asked.append(with_tokenizer)
            await asyncio.sleep(0.01)
            return "model", frozenset(), ("{}", None, 1, (2,)) if with_tokenizer else None

    async def run() -> object:
        generating = api_http.LinkGenerating(Link(), 1)
        first = asyncio.ensure_future(generating.served())
        await asyncio.sleep(0.05)  # the first has its answer and builds the tokenizer
        await generating.served()
        seen = generating.tokenizer
        await first
        return seen

    assert asyncio.run(run()) == "tokenizer"
    assert len(built) == 1 and asked == [True, False]
