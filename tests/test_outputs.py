"""Output processing against vLLM's rules: the text of the token that ends a STOP, what ended it (stop_reason), and
the text an abort releases."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.outputs import OutputProcessor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.core.step_record import TokenOutput
from scheduler_svc.core.tokenizer import ModelTokenizer
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.service_fixtures import EOS_ID, GatedExecutor, assert_idle_async, collect, token_request
from tests.test_service_options import TOKENIZER, echo, echo_request, run

WORLD, NEWLINE, IM_END = 905, 198, 2  # SmolLM2's " world", "\n" and <|im_end|> (its EOS)
PROMPT = [19556]  # "Hello"


@pytest.fixture(scope="module")
def smollm2(smollm2_folder: Path) -> ModelTokenizer:  # noqa: F811
    config = json.loads((smollm2_folder / "config.json").read_text())
    return ModelTokenizer((smollm2_folder / "tokenizer.json").read_text(), None, config.get("bos_token_id"),
                          (config["eos_token_id"],))


def finish(tokenizer: ModelTokenizer, completion: list[int], at_once: bool, **options: object):
    """The text and matched stop of ``completion`` ending a STOP, its tokens in one output or one at a time."""
    params = SamplingParams(**options)
    processor = OutputProcessor(tokenizer, PROMPT, params)
    seq = Sequence(1, PROMPT + completion, params, block_size=16, num_prompt_tokens=len(PROMPT))
    seq.finish_reason = FinishReason.STOP
    runs = [completion] if at_once else [[t] for t in completion]
    text, position, output = "", len(PROMPT), None
    for i, tokens in enumerate(runs):
        output, stop_at = processor.process(TokenOutput(seq, tokens, None, position, i == len(runs) - 1))
        assert stop_at is None
        text += output.text
        position += len(tokens)
    assert output.finish_reason is FinishReason.STOP
    return text, output.matched_stop


@pytest.mark.parametrize("at_once", [False, True], ids=["token-by-token", "window"])
@pytest.mark.parametrize("stop", [[], ["xyz"]], ids=["no-stop-strings", "stop-strings"])
def test_include_stop_str_in_output_keeps_the_stop_tokens_text(smollm2: ModelTokenizer, at_once: bool,
                                                               stop: list[str]):
    """vLLM detokenizes the token that ended a STOP unless stop-terminated without include_stop_str_in_output."""
    kept = finish(smollm2, [WORLD, NEWLINE], at_once, stop=stop, stop_token_ids=[NEWLINE],
                  include_stop_str_in_output=True)
    assert kept == (" world\n", NEWLINE)
    assert finish(smollm2, [WORLD, NEWLINE], at_once, stop=stop, stop_token_ids=[NEWLINE]) == (" world", NEWLINE)
    # An EOS is a special token: its text shows only without skip_special_tokens, and it names no stop.
    eos = {"stop": stop, "include_stop_str_in_output": True}
    assert finish(smollm2, [WORLD, IM_END], at_once, **eos) == (" world", None)
    assert finish(smollm2, [WORLD, IM_END], at_once, skip_special_tokens=False, **eos) == (" world<|im_end|>", None)
    assert finish(smollm2, [WORLD, IM_END], at_once, skip_special_tokens=False, stop=stop) == (" world", None)


def test_a_stop_string_in_the_kept_stop_tokens_text_is_what_ended_it(smollm2: ModelTokenizer):
    # vLLM matches stop strings on the text it keeps, the stop token's included: the stop string is the stop reason.
    assert finish(smollm2, [WORLD, NEWLINE], False, stop=["d\n"], stop_token_ids=[NEWLINE],
                  include_stop_str_in_output=True) == (" world\n", "d\n")


def test_the_final_response_says_which_stop_ended_it():
    ids = TOKENIZER.encode("ab STOP cd", add_special_tokens=False)

    async def work(stub):
        by_string = collect([r async for r in stub.Generate(echo_request("ab STOP cd", 20, stop=["xyz", "STOP"]))])
        last = [r async for r in stub.Generate(token_request(ids, 20, stop_token_ids=[ids[2]]))][-1]
        once = await stub.GenerateOnce(echo_request("ab STOP cd", 20, stop=["STOP"]))
        by_eos = await stub.GenerateOnce(token_request([*ids, EOS_ID], 20))
        by_length = await stub.GenerateOnce(token_request(ids, 3))
        return by_string, last, once, by_eos, by_length

    by_string, last, once, by_eos, by_length = run(echo(), work)
    assert by_string.text == "ab " and by_string.finish_reason == pb.FINISH_REASON_STOP
    assert (last.finish_reason, last.WhichOneof("stop_reason"), last.stop_token_id) == (
        pb.FINISH_REASON_STOP, "stop_token_id", ids[2])
    assert (once.WhichOneof("stop_reason"), once.stop_string) == ("stop_string", "STOP")
    assert by_eos.finish_reason == pb.FINISH_REASON_STOP and by_eos.WhichOneof("stop_reason") is None, "EOS: unset"
    assert by_length.finish_reason == pb.FINISH_REASON_LENGTH and by_length.WhichOneof("stop_reason") is None


def test_the_stop_string_of_a_stream_arrives_on_its_last_response():
    async def work(stub):
        return [r async for r in stub.Generate(echo_request("ab STOP cd", 20, stop=["STOP"]))]

    *pieces, last = run(echo(), work)
    assert last.stop_string == "STOP"
    assert all(r.WhichOneof("stop_reason") is None for r in pieces)


def test_release_gives_back_a_held_partial_stop_string(smollm2: ModelTokenizer):
    params = SamplingParams(stop=["\n\n"])
    completion = smollm2.encode(" Hello world.\n", add_special_tokens=False)
    processor = OutputProcessor(smollm2, PROMPT, params)
    seq = Sequence(1, PROMPT + completion, params, block_size=16, num_prompt_tokens=len(PROMPT))
    texts = [processor.process(TokenOutput(seq, [t], None, len(PROMPT) + k, False))[0].text
             for k, t in enumerate(completion)]
    assert "".join(texts) == " Hello world."
    assert processor.release() == "\n" and processor.release() == ""


def test_an_aborted_stream_ends_with_the_text_it_held_back():
    """Every token is held back (each could begin the stop string): the ABORT releases them, as vLLM's final output
    releases its stop buffer, so the stream's text is its tokens' text."""
    executor = GatedExecutor(echo(), steps_before_closing=3)

    async def work(stub):
        request = echo_request("a", 40, stop=["a" * 60 + "b"], ignore_eos=True)
        request.request_id, request.stream_interval = "held", 1
        call = stub.Generate(request)
        first = await call.read()
        assert await asyncio.to_thread(executor.closed.wait, 30), "the engine never reached its fourth step"
        assert list((await stub.Abort(pb.AbortRequest(request_ids=["held"]))).aborted_request_ids) == ["held"]
        executor.open.set()
        responses = [first]
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        await assert_idle_async(stub)
        return responses

    responses = run(executor, work)
    got = collect(responses)
    assert got.finish_reason == pb.FINISH_REASON_ABORT and got.token_ids
    assert got.text == TOKENIZER.decode(got.token_ids) == "a" * len(got.token_ids)
    assert all(not r.text for r in responses[:-1]), "the stop string's possible start was sent before the abort"
