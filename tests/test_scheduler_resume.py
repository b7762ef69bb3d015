"""GenerateRequest.resume through the in-process scheduler: a stream continued with the tokens it already has
gives exactly the rest of an undisturbed run (tokens, text, stop strings across the boundary, usage, limits),
and a resume no run could have produced is refused naming the field."""

from __future__ import annotations

import grpc
import pytest

from executor_svc.fakes.shadow import reference_generate
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.detokenizer import TextStream
from tests.service_fixtures import EOS_ID, collect, token_request
from tests.test_service_options import TOKENIZER, VOCAB, echo, echo_request, run, shadow

FIELD = "resume.completion_token_ids"


def resumed(request: pb.GenerateRequest, completion: list[int]) -> pb.GenerateRequest:
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.resume.completion_token_ids.extend(completion)
    return again


async def generate(stub, request: pb.GenerateRequest):
    return collect([r async for r in stub.Generate(request)])


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_resumed_stream_gives_the_rest_of_the_undisturbed_tokens(seed: int | None):
    prompt, max_tokens = list(range(3, 14)), 12
    request = token_request(prompt, max_tokens, ignore_eos=True)
    if seed is not None:
        request.sampling.seed, request.sampling.temperature = seed, 0.8
    expected = reference_generate(prompt, max_tokens, VOCAB, {0}, True, seed)
    cuts = [1, 4, 5, 11]

    async def work(stub):
        return [await generate(stub, resumed(request, expected[:k])) for k in cuts]

    for k, got in zip(cuts, run(shadow(), work), strict=True):
        assert got.token_ids == expected[k:], f"resumed after {k} tokens"
        assert got.finish_reason == pb.FINISH_REASON_LENGTH
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(prompt), max_tokens)


def text_of(token_ids: list[int], prompt: list[int], stop: list[str]) -> str:
    """The text a client holds after these completion tokens, as the scheduler streamed it."""
    stream = TextStream(TOKENIZER, prompt, stop)
    return "".join(stream.push(t)[0] for t in token_ids)


def test_a_resumed_stream_repeats_and_loses_no_text_and_stops_across_the_boundary():
    request = echo_request("ab STOP cd é", 30, stop=["STOP"])
    plain = echo_request("ab STOP cd é", 30)
    prompt = list(request.tokens.token_ids)

    async def work(stub):
        whole, unstopped = await generate(stub, request), await generate(stub, plain)
        stopped = [await generate(stub, resumed(request, whole.token_ids[:k])) for k in range(1, len(whole.token_ids))]
        cuts = range(1, len(unstopped.token_ids), 3)
        texts = [(k, await generate(stub, resumed(plain, unstopped.token_ids[:k]))) for k in cuts]
        return whole, unstopped, stopped, texts

    whole, unstopped, stopped, texts = run(echo(), work)
    assert whole.text == "ab " and whole.finish_reason == pb.FINISH_REASON_STOP
    for k, got in enumerate(stopped, start=1):
        assert text_of(whole.token_ids[:k], prompt, ["STOP"]) + got.text == whole.text, f"cut after {k}"
        assert whole.token_ids[:k] + got.token_ids == whole.token_ids
        assert got.finish_reason == pb.FINISH_REASON_STOP
    for k, got in texts:
        assert text_of(unstopped.token_ids[:k], prompt, []) + got.text == unstopped.text, f"cut after {k}"
        assert unstopped.token_ids[:k] + got.token_ids == unstopped.token_ids


def test_resumed_tokens_count_against_max_tokens_and_towards_min_tokens():
    ids = TOKENIZER.encode("ab cd", add_special_tokens=False) + [EOS_ID]
    held = token_request(ids, 40, min_tokens=len(ids) + 1)

    async def work(stub):
        limited = await generate(stub, resumed(token_request(ids, 10, ignore_eos=True), (ids * 2)[:4]))
        return limited, await generate(stub, resumed(held, ids))

    limited, min_tokens = run(echo(), work)
    assert limited.token_ids == (ids * 2)[4:10] and limited.finish_reason == pb.FINISH_REASON_LENGTH
    assert limited.usage.completion_tokens == 10
    assert min_tokens.token_ids == ids, "the resumed EOS before min_tokens did not count towards it"
    assert min_tokens.usage.completion_tokens == 2 * len(ids)


@pytest.mark.parametrize("case", ["outside the vocabulary", "max_tokens", "n", "EOS", "stop token", "stop string"])
def test_a_resume_no_run_could_have_produced_is_invalid_argument_naming_the_field(case: str):
    request = echo_request("ab STOP cd", 8, stop=["STOP"], stop_token_ids=[5])
    completion = TOKENIZER.encode("ab ", add_special_tokens=False)
    if case == "outside the vocabulary":
        completion.append(10**6)
    elif case == "max_tokens":
        completion = (completion * 8)[:8]
    elif case == "n":
        request.sampling.n = 2
    elif case == "EOS":
        completion.append(EOS_ID)
    elif case == "stop token":
        completion.append(5)
    else:
        completion = TOKENIZER.encode("ab STOP", add_special_tokens=False)

    async def work(stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, resumed(request, completion))
        return refused.value

    refused = run(echo(), work)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert FIELD in refused.details(), refused.details()
