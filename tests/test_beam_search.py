"""vLLM's ``use_beam_search`` on the completion endpoints: the beams transformers' beam search finds, end tokens
completing beams, the length penalty, streaming, the prompt's logprobs, an abort by the request's id, a client gone
mid-search, and the parameters a search cannot honour refused naming them; every block free after each."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.step import TokenLogprobs
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.beam_search import BeamSearchGeneration, BeamSettings
from scheduler_svc.api.outbox import ChoicesReader, Outbox
from scheduler_svc.core.beam_search import BeamSearch, BeamStart
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.outputs import RequestOutput, RequestUsage
from scheduler_svc.core.sequence import FinishReason
from tests.http_fixtures import Hosted, hosted, hosted_smollm2
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401

PROMPT = [5, 17, 99, 200, 3, 41, 7]
EOS = 2  # the tiny models'


def table(seed: int, vocab: int = 4) -> dict[tuple[int, ...], TokenLogprobs]:
    """A made-up model: each context's next-token logprobs over ``vocab`` tokens, all listed, likeliest first."""
    rng = np.random.default_rng(seed)

    def alternatives() -> TokenLogprobs:
        logprobs = np.log(rng.dirichlet(np.ones(vocab)))
        order = np.argsort(-logprobs)
        return TokenLogprobs(float(logprobs[order[0]]), order.tolist(), logprobs[order].tolist())

    contexts = (c for length in range(4) for c in itertools.product(range(vocab), repeat=length))
    return {context: alternatives() for context in contexts}


def search(model: dict, width: int, start: BeamStart, **options: object) -> BeamSearch:
    beams = BeamSearch(width, start, **options)
    while not beams.done:
        beams.advance([model[beam.token_ids] for beam in beams.live])
    return beams


def test_a_search_as_wide_as_the_tree_finds_the_likeliest_sequences() -> None:
    model = table(seed=1)
    best = search(model, 16, BeamStart([9], max_tokens=3)).best()

    def summed(tokens: tuple[int, ...]) -> float:
        return sum(model[tokens[:i]].top_logprobs[model[tokens[:i]].top_token_ids.index(t)]
                   for i, t in enumerate(tokens))

    exhaustive = sorted(itertools.product(range(4), repeat=3), key=summed, reverse=True)[:16]
    assert [beam.token_ids for beam in best] == exhaustive
    assert all(math.isclose(beam.cum_logprob, summed(beam.token_ids)) for beam in best)
    assert {beam.finish_reason for beam in best} == {FinishReason.LENGTH}
    ranks = [beam.logprobs[0].rank for beam in best]
    assert ranks == [model[()].top_token_ids.index(beam.token_ids[0]) + 1 for beam in best]


def likeliest(*tokens: int) -> TokenLogprobs:
    """``tokens`` in that order of likelihood, each half as likely as the one before."""
    return TokenLogprobs(math.log(0.5), list(tokens), [math.log(0.5 ** (i + 1)) for i in range(len(tokens))])


def test_an_end_token_completes_its_beam_which_may_answer_first_while_the_others_go_on() -> None:
    prompt = [9] * 9  # vLLM's length counts the prompt: a long one leaves the sums to decide
    start = BeamStart(prompt, max_tokens=3, eos_token_ids=frozenset({EOS}))
    model = {(): likeliest(4, EOS, 5), (4,): likeliest(6, 7), (4, 6): likeliest(8, 3), (5,): likeliest(3, 7),
             (4, 7): likeliest(3, 8)}
    best = search(model, 2, start).best()
    assert [(b.token_ids, b.finish_reason) for b in best] == [((), FinishReason.STOP), ((4, 6, 8), FinishReason.LENGTH)]
    assert best[0].matched_stop == EOS and len(best[0].logprobs) == 1, "as vLLM's: the EOS its stop_reason"
    assert search(model, 2, start, include_stop=True).best()[0].token_ids == (EOS,)
    assert search(model, 2, BeamStart(prompt, 3, stop_token_ids=frozenset({EOS}))).best()[0].matched_stop == EOS
    later = search(model, 2, BeamStart(prompt, 3, eos_token_ids=frozenset({EOS}), min_tokens=1)).best()
    assert all(b.finish_reason is FinishReason.LENGTH for b in later), "no beam ends before min_tokens"


def test_the_length_penalty_weighs_the_answers_lengths_as_vllm_counts_them() -> None:
    # An early end, summed -1 over the one prompt token, against a run summed -1.5 over four tokens.
    model = {(): TokenLogprobs(-0.5, [4, EOS], [-0.5, -1.0]), (4,): TokenLogprobs(-0.5, [5], [-0.5]),
             (4, 5): TokenLogprobs(-0.5, [6], [-0.5])}
    start = BeamStart([9], max_tokens=3, eos_token_ids=frozenset({EOS}))
    assert search(model, 1, start).best()[0].token_ids == (4, 5, 6), "-1.5 / 4 beats -1 / 1"
    assert search(model, 1, start, length_penalty=0.0).best()[0].token_ids == (), "the sums alone: -1 beats -1.5"


def test_only_the_first_two_alternatives_per_beam_are_candidates_whatever_the_answer_shows() -> None:
    model = {(): likeliest(4, 5, EOS), (4,): likeliest(6, 7, EOS, 8)}  # EOS third: shown, never a candidate
    start = BeamStart([9] * 9, max_tokens=2, eos_token_ids=frozenset({EOS}))
    best = search(model, 1, start).best()
    assert [(b.token_ids, b.finish_reason) for b in best] == [((4, 6), FinishReason.LENGTH)]
    assert best[0].logprobs[0].top_token_ids == [4, 5, EOS]


def test_fewer_beams_answer_where_fewer_are_left() -> None:
    model = {(): likeliest(EOS, 3, 4)}
    only = search(model, 3, BeamStart([9], 1, eos_token_ids=frozenset({EOS, 3}), min_tokens=1)).best()
    assert [b.token_ids for b in only] == [(4,)], "two of the 2 x 3 candidates end before min_tokens"
    none_left = search({(): likeliest(EOS, 3)}, 1, BeamStart([9], 2, eos_token_ids=frozenset({EOS, 3}), min_tokens=1))
    assert [(b.token_ids, b.finish_reason) for b in none_left.best()] == [((), FinishReason.LENGTH)]


class Held(ChoicesReader):
    """As ``frontend.Generation``: closing one not finished cancels it silently; its reader is never woken."""

    def close(self) -> None:
        """Nothing to free: the outbox is the test's."""


class FailingStep:
    """A source whose first step answers and whose second fails on one beam, the other never answering."""

    def __init__(self) -> None:
        self.steps = 0

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart:
        return BeamStart([1, 2, 3], 5)

    async def submit_step(self, request: pb.GenerateRequest) -> Held:
        self.steps += 1
        outbox = Outbox(None)
        if self.steps == 1:
            outbox.put_nowait(RequestOutput("", [7], [likeliest(7, 8, 9, 10)], FinishReason.LENGTH,
                                            RequestUsage(3, 1, 0)))
        elif self.steps == 2:
            outbox.put_nowait(RequestOutput(error=RequestFailed("the executor failed")))
        return Held(outbox, 1)


def test_a_step_that_fails_on_one_beam_fails_the_search_and_leaves_no_read_waiting() -> None:
    async def run() -> set[asyncio.Task]:
        generation = await BeamSearchGeneration.begin(FailingStep(), pb.GenerateRequest(request_id="x"),
                                                      BeamSettings(2), None)
        with pytest.raises(RequestFailed, match="the executor failed"):
            [batch async for batch in generation.batches()]
        await asyncio.sleep(0.05)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(run()) == set()


def test_an_aborted_search_answers_its_beams_as_they_are() -> None:
    beams = BeamSearch(2, BeamStart([9], 5))
    beams.advance([likeliest(4, 5)])
    beams.abort()
    assert beams.done and [(b.token_ids, b.finish_reason) for b in beams.best()] == [
        ((4,), FinishReason.ABORT), ((5,), FinishReason.ABORT)]


def hf_beams(folder: Path, prompt: list[int], width: int, max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search without an end token: the beams, best first, and their summed logprobs."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    config.update(num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                  return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return [s[len(prompt):].tolist() for s in out.sequences], (out.sequences_scores * max_tokens).tolist()


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def tiny(request: pytest.FixtureRequest, tiny_model_folders: dict[str, Path]) -> Iterator[Hosted]:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(tiny_model_folders["llama"]), threads=2,
                                             kv_cache_memory=16 << 20))
    with hosted(executor, api_process=request.param) as h:
        yield h


@pytest.fixture
def api(tiny: Hosted) -> Iterator[Hosted]:
    yield tiny
    tiny.assert_idle()


def beams(api: Hosted, **body: object) -> openai.types.Completion:
    options = {"prompt": PROMPT, "max_tokens": 6, "n": 3, "logprobs": 1, **body}
    extra = {"use_beam_search": True, "return_token_ids": True, **options.pop("extra_body", {})}
    return api.openai().completions.create(model=api.openai().models.list().data[0].id, extra_body=extra, **options)


def test_the_beams_are_transformers_beams_in_the_same_order(api: Hosted, tiny_model_folders) -> None:  # noqa: F811
    expected, sums = hf_beams(tiny_model_folders["llama"], PROMPT, 3, 6)
    answer = beams(api, extra_body={"ignore_eos": True})
    assert [c.token_ids for c in answer.choices] == expected
    assert [sum(c.logprobs.token_logprobs) for c in answer.choices] == pytest.approx(sums, abs=1e-3)
    assert [(c.index, c.finish_reason) for c in answer.choices] == [(0, "length"), (1, "length"), (2, "length")]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT), 18)


def test_a_stop_token_completes_a_beam_which_answers_first_for_its_short_length(api: Hosted) -> None:
    free = beams(api, extra_body={"ignore_eos": True}).choices[0].token_ids
    stop = free[1]
    answer = beams(api, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    first = answer.choices[0]
    assert (first.token_ids, first.finish_reason, first.model_extra["stop_reason"]) == (free[:1], "stop", stop)
    assert stop not in itertools.chain.from_iterable(c.token_ids for c in answer.choices[1:])
    kept = beams(api, extra_body={"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": True})
    assert kept.choices[0].token_ids == free[:2]


def test_a_search_with_fewer_beams_left_than_n_answers_only_those(api: Hosted) -> None:
    top = beams(api, n=1, max_tokens=1, logprobs=6, extra_body={"use_beam_search": False, "temperature": 0})
    ranked = [int(name.removeprefix("token_id:")) for name in top.choices[0].logprobs.top_logprobs[0]]
    answer = beams(api, max_tokens=1, extra_body={"stop_token_ids": ranked[:5], "min_tokens": 1})
    assert [(c.index, c.token_ids, c.finish_reason) for c in answer.choices] == [(0, ranked[5:], "length")]
    streamed = list(beams(api, max_tokens=1, stream=True, extra_body={"stop_token_ids": ranked[:5], "min_tokens": 1}))
    assert [c.choices[0].index for c in streamed] == [0]


def test_a_streamed_search_sends_each_choice_whole_and_scores_the_prompt_where_asked(api: Hosted) -> None:
    whole = beams(api, extra_body={"ignore_eos": True})
    chunks = list(beams(api, stream=True, extra_body={"ignore_eos": True}))
    assert sorted((c.choices[0].index, c.choices[0].token_ids) for c in chunks) == [
        (c.index, c.token_ids) for c in whole.choices]
    scored = beams(api, echo=True, extra_body={"ignore_eos": True})
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    assert len(scored.choices[0].logprobs.token_logprobs) == len(PROMPT) + 6
    assert [c.token_ids for c in scored.choices] == [c.token_ids for c in whole.choices]


def test_aborting_the_request_by_its_id_answers_the_beams_as_they_are(api: Hosted) -> None:
    answers: list[openai.types.Completion] = []
    reader = threading.Thread(target=lambda: answers.append(beams(api, max_tokens=400, extra_body={
        "ignore_eos": True, "request_id": "searching"})))
    reader.start()
    time.sleep(0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # before the first step is in, no request has the id: try again
        aborted = httpx.post(f"{api.url}/inference/v1/abort_requests", json={"request_ids": ["cmpl-searching"]})
        if aborted.json()["aborted"] == 1:
            break
        time.sleep(0.005)
    reader.join(60)
    assert aborted.json()["aborted"] == 1
    assert {c.finish_reason for c in answers[0].choices} == {"abort"}
    assert 0 < len(answers[0].choices[0].token_ids) < 400


def test_a_client_gone_mid_search_leaves_nothing_running(api: Hosted) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "n": 4, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.url}/v1/completions", json=body, timeout=0.5)
    api.assert_idle()


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["x"]}, "stop"), ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"n": 11}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"bad_words": ["a"]}, "bad_words"), ({"allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"), ({"max_tokens": 1000}, "max_tokens"),
    ({"n": 0}, "n"),
])
def test_what_a_search_cannot_honour_is_refused_naming_it(api: Hosted, extra: dict, param: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    answer = httpx.post(f"{api.url}/v1/completions", json=body, timeout=30)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, param)


def test_a_search_is_not_rendered_for_the_generate_route_which_would_sample_instead(api: Hosted) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True}
    answer = httpx.post(f"{api.url}/v1/completions/render", json=body, timeout=30)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "use_beam_search")


def test_the_default_sampling_parameters_are_accepted_with_a_search(api: Hosted) -> None:
    defaults = {"presence_penalty": 0, "repetition_penalty": 1, "stop": [], "temperature": 0.7, "seed": 3}
    answer = beams(api, extra_body={"ignore_eos": True, **defaults})
    assert answer.choices[0].token_ids == beams(api, extra_body={"ignore_eos": True}).choices[0].token_ids


@pytest.fixture(scope="module")
def chat_api(smollm2_folder: Path) -> Iterator[Hosted]:  # noqa: F811 - converts the embedded model once
    with hosted_smollm2() as h:
        yield h


def test_a_chat_search_answers_text_decoded_from_each_beam(chat_api: Hosted) -> None:
    client = chat_api.openai()
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=5, n=2,
                                            logprobs=True, top_logprobs=2,
                                            extra_body={"use_beam_search": True, "return_token_ids": True})
    tokenizer = chat_api.server.frontend.tokenizer
    for choice in answer.choices:
        assert choice.message.content == tokenizer.decode(choice.token_ids)
        assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([t], False)
                                                                     for t in choice.token_ids]
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert answer.choices[0].token_ids != answer.choices[1].token_ids
    scores = [sum(e.logprob for e in c.logprobs.content) / (answer.usage.prompt_tokens + len(c.token_ids))
              for c in answer.choices]
    assert scores == sorted(scores, reverse=True), "best first, as scored with length_penalty 1"
    batch = httpx.post(f"{chat_api.url}/v1/chat/completions/batch", timeout=30, json={
        "messages": [messages], "use_beam_search": True})
    assert (batch.status_code, batch.json()["error"]["param"]) == (400, "use_beam_search")
    responses = httpx.post(f"{chat_api.url}/v1/responses", timeout=30, json={"input": "Hi", "use_beam_search": True})
    assert (responses.status_code, json.loads(responses.text)["error"]["param"]) == (400, "use_beam_search")
    chat_api.assert_idle()
