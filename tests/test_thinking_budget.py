"""vLLM's ``thinking_token_budget``: once a request thought for its budget after ``<think>``, ``</think>`` is the only
token sampled. The executor counts from the last start marker (the prompt's included), forces the end whatever the
other settings, keeps the forced token's logprob the model's, reads a request again after tokens are taken back, and
does it inside multi-step windows; the scheduler sends the reasoning parser's markers and refuses a budget it has
none for; every route takes the budget as vLLM names it (Messages: ``thinking.budget_tokens``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from common.step import NewRequest, SamplingSettings, StepPlan
from common.step_codec import sampling_from_proto, sampling_to_proto
from executor_svc.core.request_table import PlanError, RequestState, RequestTable
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.sample.sampler import Sampler
from executor_svc.sample.thinking_budget import ThinkingCount
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.http_fixtures import hosted
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_http_reasoning import RecordingEcho
from tests.test_http_request_ids import shadow
from tests.test_http_tools import TOKENIZER
from tests.test_structured_reasoning import LIMITS, MODEL

START, END = 100, 101  # the markers of the tests that run without a tokenizer


def budgeted(budget: int, **settings: object) -> SamplingSettings:
    return SamplingSettings(thinking_token_budget=budget, thinking_start_token_id=START, thinking_end_token_id=END,
                            **settings)


def state(tokens: list[int], settings: SamplingSettings, num_prompt_tokens: int) -> RequestState:
    return RequestState(1, list(tokens), [], len(tokens), settings, num_prompt_tokens)


def test_the_count_runs_from_the_last_start_marker_with_no_end_after_it() -> None:
    count = ThinkingCount(budgeted(4))
    assert count.thought([5, 6]) is None
    assert count.thought([5, 6, START]) == 0
    assert count.thought([5, 6, START, 7, 8]) == 2
    assert count.thought([5, 6, START, 7, 8, END]) is None
    assert count.thought([5, 6, START, 7, 8, END, 9, START, 3]) == 1, "a new thinking counts afresh"
    assert count.thought([5, 6, START, 7]) == 1, "tokens taken back: read again from the start"


def sample_until(sampler: Sampler, request: RequestState, steps: int, logits: torch.Tensor) -> list[int]:
    """Greedy-or-not decoding over fixed logits that never favour the end marker."""
    out = []
    for _ in range(steps):
        token = sampler(logits.clone(), [request.sampling], [len(request.token_ids)], [request]).token_ids[0]
        request.token_ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_end_is_forced_once_the_budget_is_spent_and_only_then(temperature: float) -> None:
    logits = torch.zeros(1, 128)
    logits[0, 7] = 5.0
    logits[0, END] = -30.0  # the model would never end its thinking by itself
    sampler = Sampler(seed=0)
    settings = budgeted(3, temperature=temperature, top_k=1, min_tokens=10, ignore_eos=True)
    request = state([1, 2, START], settings, 3)  # the prompt opened the thinking, as DeepSeek-R1's template does
    assert sample_until(sampler, request, 6, logits) == [7, 7, 7, END, 7, 7], "min_tokens and top-k do not stop it"
    request = state([1, 2, START, 7], budgeted(3, temperature=temperature, top_k=1), 4)
    assert sample_until(sampler, request, 3, logits) == [7, 7, END], "the prompt's thinking tokens count"
    request = state([1, 2], budgeted(0, temperature=temperature, top_k=1), 2)
    logits[0, START] = 50.0  # the model opens a thinking itself
    assert sample_until(sampler, request, 2, logits) == [START, END], "budget 0: the thinking ends at once"


def test_the_forced_tokens_logprob_is_the_models() -> None:
    logits = torch.randn(1, 128)
    request = state([1, START, 7, 7], budgeted(2, num_logprobs=1), 1)
    output = Sampler(seed=0)(logits.clone(), [request.sampling], [4], [request])
    assert output.token_ids == [END]
    expected = torch.log_softmax(logits[0], dim=-1)[END].item()
    assert output.logprobs[0].logprob == pytest.approx(expected, abs=1e-5) and expected < -1e-3


def test_the_budget_and_its_markers_cross_the_wire() -> None:
    settings = budgeted(5)
    assert sampling_from_proto(sampling_to_proto(settings)) == settings and settings.has_logits_processors
    assert sampling_from_proto(sampling_to_proto(SamplingSettings())).thinking_token_budget is None


def request_with_budget(budget: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[5, 6]), sampling=pb.SamplingOptions(
        thinking_token_budget=budget))


def test_the_scheduler_sends_its_parsers_markers_and_refuses_a_budget_it_has_none_for() -> None:
    markers = ThinkingMarkers.of(MODEL, "qwen3")
    settings = prepare(request_with_budget(0), LIMITS, MODEL, thinking=markers).params.settings
    think, end = TOKENIZER.token_to_id("<think>"), TOKENIZER.token_to_id("</think>")
    assert (settings.thinking_token_budget, settings.thinking_start_token_id, settings.thinking_end_token_id) == (
        0, think, end)
    with pytest.raises(InvalidRequest) as refused:
        prepare(request_with_budget(3), LIMITS, MODEL)
    assert refused.value.field == "sampling.thinking_token_budget" and "--reasoning-parser" in refused.value.reason
    assert prepare(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[5])), LIMITS, MODEL,
                   thinking=markers).params.settings.thinking_token_budget is None


def test_a_real_model_ends_its_thinking_at_the_budget_inside_multi_step_windows(
        tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(tiny_model_folders["qwen3"]), block_size=8,
                                             kv_cache_memory=4 << 20, threads=1))
    engine = Engine(executor, SchedulerConfig(num_scheduler_steps=4))
    prompts = [[5, 6, 7, START], [9, START, 11, 12, 13], [20, 21]]
    free = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    budget = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, thinking_token_budget=4,
                            thinking_markers=(START, END))
    unbounded = [c.token_ids for c in engine.generate(prompts, free)]
    bounded = [c.token_ids for c in engine.generate(prompts, budget)]
    assert all(END not in tokens for tokens in unbounded), "pick markers the random model does not sample"
    assert bounded[0][:4] == unbounded[0][:4] and bounded[0][4] == END, "4 tokens of thinking, then its end"
    assert bounded[1][:1] == unbounded[1][:1] and bounded[1][1] == END, "3 of the prompt's and 1 of its own"
    assert bounded[2] == unbounded[2], "a request that does not think is not touched"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def servers():
    executor, plain_executor = RecordingEcho(), RecordingEcho()
    with hosted(executor, reasoning_parser="qwen3") as thinking, hosted(plain_executor) as plain:
        plain.executor = plain_executor
        yield executor, thinking, plain
        thinking.assert_idle()
        plain.assert_idle()


def test_the_routes_take_the_budget_as_vllm_names_it(servers) -> None:
    executor, thinking, plain = servers
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
                       ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3}})):
        sent = {**body, "thinking_token_budget": 7} if "sampling_params" not in body else {
            **body, "sampling_params": {**body["sampling_params"], "thinking_token_budget": 7}}
        assert httpx.post(f"{thinking.url}{path}", json=sent, timeout=30).status_code == 200, path
        assert executor.sampling[-1].thinking_token_budget == 7, path
        refused = httpx.post(f"{plain.url}{path}", json=sent, timeout=30)
        assert refused.status_code == 400 and "--reasoning-parser" in refused.text, path
    assert httpx.post(f"{plain.url}/v1/chat/completions", json={**chat, "thinking_token_budget": -1},
                      timeout=30).status_code == 200, "-1 is no budget, as vLLM reads it"
    for bad in (-2, 1.5, True, "3"):
        answer = httpx.post(f"{thinking.url}/v1/chat/completions", json={**chat, "thinking_token_budget": bad},
                            timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "thinking_token_budget", bad


def test_messages_thinking_budget_bounds_the_thinking_where_the_server_reads_it(servers) -> None:
    executor, thinking, plain = servers
    body = {"max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    model = httpx.get(f"{thinking.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body["model"] = model
    assert httpx.post(f"{thinking.url}/v1/messages", json=body, timeout=30).status_code == 200
    assert executor.sampling[-1].thinking_token_budget == 1024
    assert httpx.post(f"{plain.url}/v1/messages", json=body, timeout=30).status_code == 200, \
        "a server that reads no thinking has none to bound"
    assert plain.executor.sampling[-1].thinking_token_budget is None
    refused = httpx.post(f"{thinking.url}/v1/messages", json={**body, "max_tokens": 1024}, timeout=30)
    assert refused.status_code == 400 and "budget_tokens" in refused.text


def test_the_in_process_engine_refuses_a_budget_it_cannot_count(make_shadow_engine) -> None:
    engine, _ = make_shadow_engine()
    for params, reason in ((SamplingParams(thinking_token_budget=2), "--reasoning-parser"),
                           (SamplingParams(thinking_token_budget=-1, thinking_markers=(START, END)), ">= 0")):
        with pytest.raises(InvalidRequest) as refused:
            engine.add_request([1, 2, 3], params)
        assert refused.value.field == "thinking_token_budget" and reason in refused.value.reason


def test_a_grammar_that_already_applies_is_left_to_decide() -> None:
    """A grammar from the first token in a prompt that opened a thinking: a forced </think> would break it."""
    logits = torch.zeros(1, 128)
    logits[0, 7] = 5.0
    request = state([1, START, 7, 7, 7], budgeted(1), 1)
    request.matcher = object()  # what constraints.mask leaves on a row whose grammar applies
    assert Sampler(seed=0)(logits.clone(), [request.sampling], [5], [request]).token_ids == [7]
    request.matcher = None  # a grammar that waits for the thinking's end: the budget forces it
    assert Sampler(seed=0)(logits.clone(), [request.sampling], [5], [request]).token_ids == [END]


def test_markers_outside_the_vocabulary_are_refused_before_they_reach_a_step(make_shadow_engine) -> None:
    engine, _ = make_shadow_engine(vocab_size=50)
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([1, 2, 3], SamplingParams(thinking_token_budget=2, thinking_markers=(10, 10**6)))
    assert refused.value.field == "thinking_token_budget" and "outside the vocabulary" in refused.value.reason
    table = RequestTable(num_blocks=8, block_size=4, vocab_size=50, max_model_len=64)
    for settings in (budgeted(2), SamplingSettings(thinking_token_budget=2, thinking_start_token_id=3)):
        new = NewRequest(1, [1, 2, 3], settings, [0], num_scheduled_tokens=3)
        with pytest.raises(PlanError, match="both markers in the vocabulary"):
            table.apply(StepPlan(step_id=1, is_prefill=True, new_requests=[new]))


def test_messages_budget_bounds_nothing_over_a_vocabulary_without_the_markers() -> None:
    """--reasoning-parser over a vocabulary without <think> and </think> (the scheduler warns): nothing to count."""
    with hosted(shadow(), reasoning_parser="qwen3") as server:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        answer = httpx.post(f"{server.url}/v1/messages", json={**body, "max_tokens": 3}, timeout=30)
        assert answer.status_code == 400, "budget_tokens must still be below max_tokens"
        assert httpx.post(f"{server.url}/v1/messages", json=body, timeout=30).status_code == 200
        server.assert_idle()
