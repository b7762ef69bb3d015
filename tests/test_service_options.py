"""The options of vLLM's gRPC engine API that the scheduler serves: n choices, Abort, Tokenize and Detokenize,
min_tokens, stop strings kept in the text, special tokens, prompt truncation, allowed_token_ids and bad_words, and
what reaches the executor."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest

from client.request_builder import build_request
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from executor_svc.fakes.shadow_server import EchoExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.bad_words import bad_words_token_ids
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    EOS_ID,
    TOKENIZER_VOCAB_SIZE,
    GatedExecutor,
    assert_idle_async,
    byte_level_tokenizer,
    collect,
    in_process_scheduler,
    token_request,
)
from tests.test_service_loop import RecordingExecutor

VOCAB = 50
TOKENIZER_JSON = byte_level_tokenizer().to_str()
TOKENIZER = ModelTokenizer(TOKENIZER_JSON, CHATML_TEMPLATE, None, (EOS_ID,))


def shadow(**kwargs) -> ShadowExecutor:
    return ShadowExecutor(**{"num_blocks": 128, "block_size": 4, "vocab_size": VOCAB, **kwargs})


def echo() -> EchoExecutor:
    """Each completion repeats its prompt, so a test can place stop strings, EOS and special tokens exactly."""
    return EchoExecutor(ExecutorInfo(
        instance_id="echo", model_id="echo", vocab_size=TOKENIZER_VOCAB_SIZE, eos_token_ids=(EOS_ID,),
        max_model_len=256, block_size=4, num_blocks=256, tokenizer_json=TOKENIZER_JSON, chat_template=CHATML_TEMPLATE,
    ))


def choices(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    by_index: dict[int, list[pb.GenerateResponse]] = {}
    for response in responses:
        by_index.setdefault(response.index, []).append(response)
    return by_index


def run(executor: object, work, **config: object):
    async def main():
        async with in_process_scheduler(executor, **config) as s:
            result = await work(s.stub)
            await assert_idle_async(s.stub)
            return result

    return asyncio.run(main())


def test_n_seeded_choices_stream_by_index_reproducibly_and_count_the_prompt_once():
    prompt = [5, 6, 7, 8, 9]
    request = token_request(prompt, 6, ignore_eos=True)
    request.sampling.seed, request.sampling.n = 11, 4

    async def work(stub):
        runs = []
        for _ in range(2):
            runs.append([r async for r in stub.Generate(request)])
        return runs

    first, second = run(shadow(), work)
    params = SamplingParams(seed=11, n=4)
    by_index = {i: collect(responses) for i, responses in choices(first).items()}
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, got in by_index.items():
        assert got.token_ids == reference_generate(prompt, 6, VOCAB, {0}, True, params.for_choice(i).seed)
        assert got.finish_reason == pb.FINISH_REASON_LENGTH
    assert len({tuple(got.token_ids) for got in by_index.values()}) == 4, "the choices were not seeded apart"
    assert {i: collect(r).token_ids for i, r in choices(second).items()} == {
        i: got.token_ids for i, got in by_index.items()}
    assert [by_index[i].usage.prompt_tokens for i in range(4)] == [5, 0, 0, 0]
    assert sum(got.usage.completion_tokens for got in by_index.values()) == 24


def test_n_choices_compute_the_prompt_once_even_when_sent_together():
    executor = RecordingExecutor(shadow(num_blocks=256))
    prompt, block_size = list(range(1, 38)), 4
    request = token_request(prompt, 5, ignore_eos=True)
    request.sampling.n = 8

    async def work(stub):
        return [r async for r in stub.Generate(request)]

    responses = run(executor, work)
    assert sum(len(r.token_ids) for r in responses) == 8 * 5
    computed = sum(
        sum(n.num_scheduled_tokens for n in plan.new_requests)
        + (sum(plan.cached_requests.num_decode_steps) or sum(plan.cached_requests.num_scheduled_tokens))
        for plan in executor.plans
    )
    assert computed <= len(prompt) + 8 * 5 + 7 * block_size, computed


def test_generate_once_refuses_n_above_one():
    async def work(stub):
        request = token_request([1, 2], 3)
        request.sampling.n = 2
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GenerateOnce(request)
        return refused.value

    refused = run(shadow(), work)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details().startswith("sampling.n:")


def test_abort_by_id_ends_every_choice_with_abort_and_frees_the_blocks():
    executor = GatedExecutor(shadow(num_blocks=1024), steps_before_closing=2)

    async def work(stub):
        request = token_request([3, 4, 5], 500, ignore_eos=True)
        request.request_id, request.sampling.n = "gateway-7", 2
        call = stub.Generate(request)
        first = await call.read()
        assert await asyncio.to_thread(executor.closed.wait, 30), "the engine never reached its third step"
        aborted = await stub.Abort(pb.AbortRequest(request_ids=["gateway-7", "never-sent"]))
        executor.open.set()
        rest = []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
        stats = await assert_idle_async(stub)
        again = await stub.Abort(pb.AbortRequest(request_ids=["gateway-7"]))
        return first, aborted, rest, stats, again

    first, aborted, rest, stats, again = run(executor, work)
    assert list(aborted.aborted_request_ids) == ["gateway-7"]
    finals = [r for r in [first, *rest] if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finals) == [0, 1]
    assert all(r.finish_reason == pb.FINISH_REASON_ABORT for r in finals)
    for final in finals:  # each choice's usage counts what it generated, the prompt once (on choice 0)
        received = sum(len(r.token_ids) for r in [first, *rest] if r.index == final.index)
        assert final.usage.completion_tokens == received, (final.index, final.usage, received)
        assert final.usage.prompt_tokens == (3 if final.index == 0 else 0)
    assert stats.num_aborted == 2
    assert list(again.aborted_request_ids) == [], "a finished request is no longer abortable"


def test_tokenize_and_detokenize_match_the_models_tokenizer():
    async def work(stub):
        text = await stub.Tokenize(pb.TokenizeRequest(text="Hello world"))
        plain = await stub.Tokenize(pb.TokenizeRequest(text="Hello world", add_special_tokens=False))
        chat = await stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[
            pb.ChatMessage(role="user", content="hi")])))
        back = await stub.Detokenize(pb.DetokenizeRequest(token_ids=text.token_ids))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, TOKENIZER_VOCAB_SIZE]))
        return text, plain, chat, back, refused.value

    text, plain, chat, back, refused = run(echo(), work)
    assert list(text.token_ids) == TOKENIZER.encode("Hello world") and text.count == len(text.token_ids)
    assert list(plain.token_ids) == TOKENIZER.encode("Hello world", add_special_tokens=False)
    assert list(chat.token_ids) == TOKENIZER.encode_chat([ChatMessage("user", "hi")])
    assert text.max_model_len == 256 and back.text == "Hello world"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in refused.details()


def test_chat_template_kwargs_reach_the_template_and_its_own_variables_are_refused():
    hi = [pb.ChatMessage(role="user", content="hi")]

    async def work(stub):
        off = pb.ChatPrompt(messages=hi)
        off.template_kwargs.update({"enable_thinking": False, "unused": 1})
        plain = await stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=hi)))
        thinking_off = await stub.Tokenize(pb.TokenizeRequest(chat=off))
        taken = pb.ChatPrompt(messages=hi)
        taken.template_kwargs.update({"messages": [], "bos_token": "x"})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Tokenize(pb.TokenizeRequest(chat=taken))
        return plain, thinking_off, refused.value

    plain, thinking_off, refused = run(echo(), work)
    assert list(plain.token_ids) == TOKENIZER.encode_chat([ChatMessage("user", "hi")])
    assert TOKENIZER.decode(list(thinking_off.token_ids), False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "chat.template_kwargs: bos_token, messages: set by the server, not by a request"


def echo_request(text: str, max_tokens: int, **stopping: object) -> pb.GenerateRequest:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    return token_request(ids, max_tokens, **stopping)


def test_min_tokens_holds_eos_and_stop_strings_back_until_reached():
    prompt = "ab STOP cd"  # a token a character: "STOP" is completion tokens 3 to 6
    ids = TOKENIZER.encode(prompt, add_special_tokens=False) + [EOS_ID]

    async def work(stub):
        plain = collect([r async for r in stub.Generate(token_request(ids, 40))])
        held = collect([r async for r in stub.Generate(token_request(ids, 40, min_tokens=len(ids) + 1))])
        stopped = collect([r async for r in stub.Generate(echo_request(prompt * 3, 40, stop=["STOP"]))])
        within = collect([r async for r in stub.Generate(echo_request(prompt * 3, 40, stop=["STOP"], min_tokens=7))])
        after = collect([r async for r in stub.Generate(echo_request(prompt * 3, 40, stop=["STOP"], min_tokens=6))])
        first = collect([r async for r in stub.Generate(echo_request("\nab\ncd", 40, stop=["\n"], min_tokens=1))])
        return plain, held, stopped, within, after, first

    plain, held, stopped, within, after, first = run(echo(), work)
    assert plain.token_ids == ids and plain.finish_reason == pb.FINISH_REASON_STOP
    assert held.token_ids == ids + ids, "EOS ended the completion before min_tokens"
    assert stopped.text == "ab "
    assert within.text == "ab STOP cdab ", "a stop string within min_tokens ended the completion"
    assert after.text == "ab " and after.finish_reason == pb.FINISH_REASON_STOP, "ending past min_tokens, it counts"
    assert first.text == "\nab", "min_tokens 1: the first token's stop string does not end it (vLLM's rule)"


def test_the_stop_string_stays_in_the_text_when_asked():
    async def work(stub):
        kept = await stub.GenerateOnce(echo_request("say STOP now", 20, stop=["STOP"], include_stop_str_in_output=True))
        return kept

    kept = run(echo(), work)
    assert kept.text == "say STOP" and kept.finish_reason == pb.FINISH_REASON_STOP


def test_special_tokens_show_in_the_text_only_when_asked():
    ids = TOKENIZER.encode("hi", add_special_tokens=False) + [EOS_ID]

    async def work(stub):
        skipped = await stub.GenerateOnce(token_request(ids, len(ids), ignore_eos=True))
        request = token_request(ids, len(ids), ignore_eos=True)
        request.skip_special_tokens = False
        shown = await stub.GenerateOnce(request)
        return skipped, shown

    skipped, shown = run(echo(), work)
    assert skipped.text == "hi" and shown.text == "hi<|endoftext|>"


def test_a_truncated_prompt_keeps_its_last_tokens():
    async def work(stub):
        request = token_request(list(range(1, 21)), 4, ignore_eos=True)
        request.truncate_prompt_tokens = 6
        return await stub.GenerateOnce(request)

    response = run(shadow(), work)
    assert response.usage.prompt_tokens == 6
    assert list(response.token_ids) == reference_generate(list(range(15, 21)), 4, VOCAB, {0}, True)


def test_penalties_logit_bias_and_min_tokens_reach_the_executor_once_per_request():
    executor = RecordingExecutor(shadow())

    async def work(stub):
        request = token_request([1, 2, 3], 4, min_tokens=2, stop_token_ids=[9])
        s = request.sampling
        s.repetition_penalty, s.presence_penalty, s.frequency_penalty = 1.3, 0.5, -0.25
        s.logit_bias[7] = -100.0
        return await stub.GenerateOnce(request)

    run(executor, work)
    news = list(itertools.chain.from_iterable(plan.new_requests for plan in executor.plans))
    assert len(news) == 1
    sampling = news[0].sampling
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == pytest.approx(
        (1.3, 0.5, -0.25))
    assert dict(sampling.logit_bias) == {7: -100.0}
    assert (sampling.min_tokens, list(sampling.stop_token_ids), sampling.ignore_eos) == (2, [9], False)
    assert news[0].num_prompt_tokens == 3


def test_a_stream_interval_sends_runs_of_that_many_tokens_after_the_first_and_the_same_completion():
    request = token_request([3, 4, 5], max_tokens=11, ignore_eos=True)

    async def work(stub):
        return [response async for response in stub.Generate(request)]

    each = run(shadow(), work)
    gathered = run(shadow(), work, stream_interval=4)
    assert collect(gathered) == collect(each) and len(collect(each).token_ids) == 11
    assert len(gathered[0].token_ids) >= 1 and all(len(r.token_ids) >= 4 for r in gathered[1:-1])
    assert len(gathered) <= 4 and gathered[-1].finish_reason == pb.FINISH_REASON_LENGTH


class PacedExecutor(RecordingExecutor):
    """Steps that take 10 ms, as a device's would, so that a reader keeps up and gets every message on its own."""

    def step(self, plan: StepPlan) -> StepResult:
        time.sleep(0.01)
        return super().step(plan)


def test_a_request_chooses_its_own_stream_interval_over_the_servers():
    def request(interval: int) -> pb.GenerateRequest:
        r = token_request([3, 4, 5], max_tokens=11, ignore_eos=True)
        r.stream_interval = interval
        return r

    async def work(stub):
        runs = []
        for interval in (5, 1):
            runs.append([response async for response in stub.Generate(request(interval))])
        return runs

    gathered, each = run(PacedExecutor(shadow()), work, stream_interval=3)
    assert collect(gathered) == collect(each) and len(collect(each).token_ids) == 11
    assert [len(r.token_ids) for r in gathered] == [1, 5, 5]
    assert [len(r.token_ids) for r in each] == [1] * 11



def test_allowed_token_ids_and_bad_words_reach_the_executor_once_per_request_as_token_ids():
    executor = RecordingExecutor(echo())
    words = ["world", " Hello", "world", "héllo wörld"]

    async def work(stub):  # as the Python client sends them
        request = build_request(token_ids=[5, 6], max_tokens=4, allowed_token_ids=[9, 3, 9, 5], bad_words=words)
        return await stub.GenerateOnce(request)

    run(executor, work)
    news = list(itertools.chain.from_iterable(plan.new_requests for plan in executor.plans))
    assert len(news) == 1
    sampling = news[0].sampling
    assert sampling.allowed_token_ids == (3, 5, 9)
    expected = bad_words_token_ids(words, TOKENIZER)
    assert sampling.bad_words_token_ids == tuple(map(tuple, expected))
    assert len(expected) >= 4 and all(expected), "vLLM's rule keeps each word and, where it differs, its spaced form"


def test_allowed_token_ids_and_bad_words_are_refused_naming_the_field():
    def request(allowed: list[int] | None = None, words: tuple[str, ...] | list[str] = (),
                resumed: tuple[int, ...] | list[int] = ()) -> pb.GenerateRequest:
        r = echo_request("ab cd", 8)
        if allowed is not None:
            r.sampling.allowed_token_ids.SetInParent()
            r.sampling.allowed_token_ids.token_ids.extend(allowed)
        r.sampling.bad_words.extend(words)
        r.resume.completion_token_ids.extend(resumed)
        return r

    ab = TOKENIZER.encode("ab", add_special_tokens=False)
    bad = {
        "empty allowed list": (build_request(token_ids=[5], allowed_token_ids=[]),
                               "sampling.allowed_token_ids: when given, it must hold at least one"),
        "id outside the vocabulary": (request([3, TOKENIZER_VOCAB_SIZE]), "sampling.allowed_token_ids: token id 300"),
        "empty word": (request(words=["fine", ""]), "sampling.bad_words: bad words must not be empty"),
        "blank word": (request(words=["   "]), "sampling.bad_words: '   ' encodes to no tokens"),
        "too many": (request(words=[f"w{i}" for i in range(129)]), "sampling.bad_words: at most 128 token"),
        "resumed outside": (request([ab[0]], resumed=ab), "resume.completion_token_ids: token id"),
        "resumed word": (request(words=["ab"], resumed=ab), "resume.completion_token_ids: token id"),
    }

    async def work(stub):
        refusals = {}
        for name, (r, _) in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GenerateOnce(r)
            refusals[name] = refused.value
        fine = await stub.GenerateOnce(request(sorted(set(ab)), words=["zz"], resumed=ab[:1]))
        return refusals, fine

    refusals, fine = run(echo(), work)
    for name, (_, details) in bad.items():
        assert refusals[name].code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert refusals[name].details().startswith(details), (name, refusals[name].details())
    assert fine.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    async def without_tokenizer(stub):
        r = token_request([1, 2], 2)
        r.sampling.bad_words.append("x")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GenerateOnce(r)
        return refused.value

    refused = run(shadow(), without_tokenizer)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "sampling.bad_words: bad words need a tokenizer and this executor has none"
