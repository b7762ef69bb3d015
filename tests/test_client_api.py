"""The Python client library against a real scheduler + echo executor pair (subprocesses)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from client import AsyncClient, Client, NanoserveError
from client.failover import JOINED_STREAM_INTERVAL, read_whole
from client.request_builder import build_request
from nanoserve.v1 import generation_pb2 as pb
from tests.service_fixtures import TOKENIZER_VOCAB_SIZE, assert_idle, executor_argv, free_port, running_stack

if TYPE_CHECKING:
    from tests.client_fixtures import EchoServer

pytest_plugins = ["tests.client_fixtures"]

PROMPT = "Hello world"


@pytest.fixture
def client(echo_server: EchoServer) -> Client:
    with Client(echo_server.target, timeout=30) as c:
        yield c


def test_generate_returns_the_completion_text_ids_reason_and_usage(client: Client, echo_server: EchoServer) -> None:
    text, token_ids = echo_server.echo(PROMPT, 9)
    completion = client.generate(PROMPT, max_tokens=9, temperature=0)
    assert completion.text == text
    assert completion.token_ids == token_ids
    assert completion.finish_reason == "length"
    prompt_tokens = len(echo_server.tokenizer.encode(PROMPT).ids)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 9)
    assert completion.request_id


def test_generate_asks_for_several_tokens_a_response_unless_told():
    assert read_whole(build_request(token_ids=[1])).stream_interval == JOINED_STREAM_INTERVAL > 1
    assert read_whole(build_request(token_ids=[1], stream_interval=1)).stream_interval == 1
    assert not build_request(token_ids=[1]).HasField("stream_interval")


def test_stream_yields_pieces_that_join_to_the_completion(client: Client, echo_server: EchoServer) -> None:
    chunks = list(client.stream(PROMPT, max_tokens=12))
    assert "".join(c.text for c in chunks) == echo_server.echo(PROMPT, 12)[0]
    assert [t for c in chunks for t in c.token_ids] == echo_server.echo(PROMPT, 12)[1]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12


def test_stop_string_ends_the_text_before_it(client: Client) -> None:
    completion = client.generate(PROMPT, max_tokens=30, stop=" world")
    assert completion.text == "Hello"
    assert completion.finish_reason == "stop"


def test_token_prompt_and_stop_token_ids(client: Client) -> None:
    assert client.generate(token_ids=[5, 6, 7], max_tokens=7).token_ids == [5, 6, 7, 5, 6, 7, 5]
    stopped = client.generate(token_ids=[5, 6, 7], max_tokens=7, stop_token_ids=[7])
    assert stopped.finish_reason == "stop" and stopped.token_ids[:2] == [5, 6]


def test_chat_renders_the_messages_with_the_model_template(client: Client, echo_server: EchoServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    completion = client.chat(messages, max_tokens=4)
    assert completion.usage.prompt_tokens == echo_server.chat_prompt_tokens(messages)
    assert completion.finish_reason == "length"


def test_invalid_request_raises_with_the_status_and_the_field(client: Client) -> None:
    with pytest.raises(NanoserveError) as error:
        client.generate(PROMPT, max_tokens=0)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in error.value.message
    with pytest.raises(NanoserveError) as error:
        list(client.stream(token_ids=[TOKENIZER_VOCAB_SIZE + 1]))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in error.value.message


def test_a_prompt_must_be_given_exactly_once(client: Client) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        client.generate(PROMPT, token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        client.stream()


def test_generate_gives_one_completion_and_choices_gives_n(client: Client, echo_server: EchoServer) -> None:
    with pytest.raises(ValueError, match=r"n=2 asks for 2 completions: choices\(\) returns them"):
        client.generate(PROMPT, max_tokens=3, n=2)
    text, _ = echo_server.echo(PROMPT, 3)
    assert [c.text for c in client.choices(PROMPT, max_tokens=3, n=2, temperature=0)] == [text, text]

    async def run() -> None:
        async with AsyncClient(echo_server.target, timeout=30) as aclient:
            with pytest.raises(ValueError, match="n=3 asks for 3 completions"):
                await aclient.chat([{"role": "user", "content": "hi"}], n=3)

    asyncio.run(run())


def test_model_info_stats_and_health(client: Client) -> None:
    info = client.model_info()
    assert (info.model_id, info.vocab_size, info.has_tokenizer, info.has_chat_template) == (
        "echo", TOKENIZER_VOCAB_SIZE, True, True)
    client.generate(PROMPT, max_tokens=2)
    assert_idle(client.stub)
    stats = client.stats()
    assert stats.num_steps > 0 and stats.num_finished_length > 0
    assert client.health() == "SERVING"


def test_closing_a_stream_early_cancels_the_request_on_the_server(tmp_path: Path) -> None:
    port = free_port()
    executor = executor_argv("shadow", port, {"max_model_len": 16_000})
    with running_stack(executor, tmp_path, executor_port=port) as stack, Client(stack.target, timeout=30) as client:
        chunks = client.stream(token_ids=[1, 2, 3], max_tokens=15_000, ignore_eos=True)
        assert next(chunks).finish_reason is None
        chunks.close()
        assert assert_idle(client.stub).num_aborted == 1


def test_unreachable_server_raises_unavailable() -> None:
    with Client(f"127.0.0.1:{free_port()}", timeout=5) as client, pytest.raises(NanoserveError) as error:
        client.health()
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_async_client_matches_the_sync_one(echo_server: EchoServer) -> None:
    async def run() -> tuple:
        async with AsyncClient(echo_server.target, timeout=30) as client:
            completion = await client.generate(PROMPT, max_tokens=6)
            chunks = [c async for c in client.stream(PROMPT, max_tokens=6)]
            chat = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
            with pytest.raises(NanoserveError) as error:
                await client.generate(PROMPT, temperature=-1.0)
            return completion, chunks, chat, error.value, await client.health(), await client.model_info()

    completion, chunks, chat, error, health, info = asyncio.run(run())
    assert completion.text == "".join(c.text for c in chunks) == echo_server.echo(PROMPT, 6)[0]
    assert chunks[-1].finish_reason == completion.finish_reason == "length"
    assert chat.usage.completion_tokens == 2
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.message
    assert health == "SERVING" and info.model_id == "echo"


def test_a_chunk_reads_every_field_whichever_path_it_takes() -> None:
    from client.results import Chunk, TokenLogprob, Usage
    from nanoserve.v1 import generation_pb2 as pb

    middle = pb.GenerateResponse(request_id="r", index=2, text="ab", token_ids=[5, 6])
    assert Chunk.from_proto(middle) == Chunk("r", "ab", [5, 6], [], None, None, 2, [])
    scored = pb.GenerateResponse(request_id="r", text="a", token_ids=[5], logprobs=[pb.TokenLogprob(
        token_id=5, logprob=-0.5, top=[pb.Logprob(token_id=5, logprob=-0.5)])])
    assert Chunk.from_proto(scored).logprobs == [TokenLogprob(5, -0.5, [(5, -0.5)])]
    ranked = pb.GenerateResponse(request_id="r", logprobs=[pb.TokenLogprob(token_id=5, logprob=-2.5, rank=3)])
    assert Chunk.from_proto(ranked).logprobs[0].rank == 3
    last = pb.GenerateResponse(request_id="r", token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH,
                               usage=pb.Usage(prompt_tokens=3, completion_tokens=4))
    chunk = Chunk.from_proto(last)
    assert (chunk.token_ids, chunk.finish_reason, chunk.usage) == ([7], "length", Usage(3, 4, 0))


def test_a_stop_reason_says_which_stop_ended_the_completion(client: Client) -> None:
    assert client.generate(PROMPT, max_tokens=30, stop=["xyz", " world"]).stop_reason == " world"
    assert client.generate(token_ids=[5, 6, 7], max_tokens=7, stop_token_ids=[7]).stop_reason == 7
    assert client.generate(PROMPT, max_tokens=3).stop_reason is None, "a length finish has none"
    chunks = list(client.stream(token_ids=[5, 6, 7], max_tokens=7, stop_token_ids=[6], stream_interval=1))
    assert [c.stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [6]
    (choice,) = client.choices(token_ids=[5, 6, 7], max_tokens=7, stop_token_ids=[6])
    assert choice.stop_reason == 6


def test_a_chunk_reads_the_stop_reason_of_either_kind() -> None:
    from client.results import Chunk, Completion
    from nanoserve.v1 import generation_pb2 as pb

    stop = pb.FINISH_REASON_STOP
    assert Chunk.from_proto(pb.GenerateResponse(finish_reason=stop, stop_string="\n\n")).stop_reason == "\n\n"
    assert Completion.from_proto(pb.GenerateResponse(finish_reason=stop, stop_token_id=0)).stop_reason == 0
    assert Chunk.from_proto(pb.GenerateResponse(finish_reason=stop)).stop_reason is None, "an EOS: none"


def test_the_async_client_loads_and_unloads_lora_adapters_as_the_sync_one(client: Client,
                                                                         echo_server: EchoServer) -> None:
    async def run() -> list[NanoserveError]:
        errors = []
        async with AsyncClient(echo_server.target, timeout=30) as aclient:
            for call in (aclient.load_lora("a1", "/adapters/a1"), aclient.unload_lora("a1")):
                with pytest.raises(NanoserveError) as error:
                    await call
                errors.append(error.value)
        return errors

    refused, unknown = asyncio.run(run())
    with pytest.raises(NanoserveError) as sync_refused:
        client.load_lora("a1", "/adapters/a1")
    # The echo executor loads no adapters at run time, and none is served.
    assert (refused.code, refused.message) == (sync_refused.value.code, sync_refused.value.message)
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and unknown.code == grpc.StatusCode.NOT_FOUND


class LoraStub:
    """Records the LoadLoraRequests a client sends."""

    def __init__(self, asynchronous: bool) -> None:
        self.requests: list = []
        self.asynchronous = asynchronous

    def LoadLoraAdapter(self, request, **_):  # noqa: N802 (the stub's name)
        from nanoserve.v1 import generation_pb2 as pb

        self.requests.append(request)
        card = pb.LoraAdapterCard(name=request.lora_name, path=request.lora_path)
        if not self.asynchronous:
            return card

        async def answer():
            return card
        return answer()


def test_load_inplace_reaches_the_request_from_both_clients() -> None:
    sync_stub, async_stub = LoraStub(False), LoraStub(True)
    with Client(f"127.0.0.1:{free_port()}") as sync_client:
        sync_client.stub = sync_stub
        sync_client.load_lora("a1", "/adapters/a1-v2", load_inplace=True)
        sync_client.load_lora("a1", "/adapters/a1")

    async def run() -> None:
        async with AsyncClient(f"127.0.0.1:{free_port()}") as async_client:
            async_client._connect()
            async_client._stub = async_stub
            assert (await async_client.load_lora("a1", "/adapters/a1-v2", load_inplace=True)).name == "a1"
            await async_client.load_lora("a1", "/adapters/a1")

    asyncio.run(run())
    for stub in (sync_stub, async_stub):
        assert [(r.lora_name, r.lora_path, r.load_inplace) for r in stub.requests] == [
            ("a1", "/adapters/a1-v2", True), ("a1", "/adapters/a1", False)]


def test_max_tokens_to_room_and_truncate_prompt_tokens_minus_one(tmp_path: Path) -> None:
    room = build_request(token_ids=[1], max_tokens_to_room=True)
    assert room.stopping.HasField("max_tokens_to_room") and room.stopping.max_tokens_to_room
    assert not build_request(token_ids=[1]).stopping.HasField("max_tokens_to_room")
    assert build_request(token_ids=[1], cap_max_tokens_to_room=True).stopping.cap_max_tokens_to_room
    assert build_request(token_ids=[1], truncate_prompt_tokens=-1).truncate_prompt_tokens == 2**32 - 1
    assert build_request(token_ids=[1], truncation_side="right").truncation_side == pb.TRUNCATION_SIDE_RIGHT
    assert build_request(token_ids=[1], truncation_side="left").truncation_side == pb.TRUNCATION_SIDE_LEFT
    with pytest.raises(ValueError, match="truncation_side"):
        build_request(token_ids=[1], truncation_side="up")
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        build_request(token_ids=[1], truncate_prompt_tokens=-2)
    port, prompt = free_port(), [5, 6, 7]
    # A model of 300 tokens: the room a prompt leaves is more than the default 256.
    executor = executor_argv("shadow", port, {"max_model_len": 300})
    with running_stack(executor, tmp_path, executor_port=port) as stack, Client(stack.target, timeout=60) as client:
        whole = client.generate(token_ids=prompt, max_tokens_to_room=True, ignore_eos=True)
        default = client.generate(token_ids=prompt, ignore_eos=True)
        kept = client.generate(token_ids=prompt, max_tokens=2, truncate_prompt_tokens=-1)
        first = client.generate(token_ids=prompt, max_tokens=1, truncate_prompt_tokens=2, truncation_side="right",
                                return_prompt_token_ids=True)
        capped = client.generate(token_ids=prompt, max_tokens=1000, cap_max_tokens_to_room=True, ignore_eos=True)
        with pytest.raises(NanoserveError, match="exceeds the model's maximum length"):
            client.generate(token_ids=prompt, max_tokens=1000)
    assert capped.finish_reason == "length" and capped.usage.completion_tokens == 300 - len(prompt)
    assert whole.finish_reason == "length" and whole.usage.completion_tokens == 300 - len(prompt)
    assert default.usage.completion_tokens == 256
    assert kept.usage.prompt_tokens == len(prompt), "-1 keeps the model's length: all of a prompt that fits"
    assert first.prompt_token_ids == prompt[:2]
