"""vLLM's ``repetition_detection``: a completion ends, with finish reason ``repetition`` and stop reason
``repetition_detected``, at the token that completes a pattern of ``min_pattern_size`` to ``max_pattern_size`` tokens
repeated ``min_count`` times in a row, counted from ``min_tokens`` on and after stop tokens; inside multi-step windows
and across the gRPC API, the HTTP routes, the client, the stats and the metrics; refused as vLLM refuses it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from client.request_builder import build_request
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.core.stop_rules import StopRule, repeats
from tests.http_fixtures import Hosted, hosted
from tests.test_service_loop import LogprobExecutor
from tests.test_service_options import echo

PROMPT = [5, 6, 7]  # the echo executor's completion: 5, 6, 7, 5, 6, 7, ...


def rule(repetition: tuple[int, int, int], min_tokens: int = 0, stop: frozenset[int] = frozenset()) -> StopRule:
    params = SamplingParams(max_tokens=100, min_tokens=min_tokens, stop_token_ids=stop, repetition_detection=repetition)
    return StopRule.of(params, 0, (), 4096)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=14), sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
       count=st.integers(2, 4))
def test_a_repetition_is_a_tail_of_count_equal_runs_of_some_allowed_size(tokens, sizes, count) -> None:
    low, high = sizes[0], sizes[0] + sizes[1]
    expected = any(len(tokens) >= size * count
                   and all(tokens[len(tokens) - size * (m + 1):len(tokens) - size * m] == tokens[-size:]
                           for m in range(count))
                   for size in range(low, high + 1))
    assert repeats(tokens, len(tokens), low, high, count) == expected


def test_the_rule_ends_at_the_token_completing_the_pattern_reading_the_tokens_before_the_window() -> None:
    pattern = rule((1, 3, 2))
    assert pattern.check([1, 2, 3, 1, 2, 3, 9], 0) == (6, FinishReason.REPETITION)
    assert pattern.check([2, 3, 9], 4, [1, 2, 3, 1, 0, 0]) == (2, FinishReason.REPETITION), "it began before"
    prompted = StopRule.of(SamplingParams(max_tokens=100, repetition_detection=(1, 1, 3)), 2, (), 4096)
    assert prompted.check([5], 1, [5, 5, 5, 0]) == (1, None), "5 three times only with the prompt's, which don't count"
    assert prompted.check([5], 2, [5, 5, 5, 5, 0]) == (1, FinishReason.REPETITION)
    assert pattern.check([1, 2, 3, 4], 0) == (4, None)
    assert rule((1, 3, 2), min_tokens=8).check([1, 2, 3, 1, 2, 3, 1, 2, 3], 0) == (8, FinishReason.REPETITION), (
        "from min_tokens on: 2, 3, 1 twice ends the eighth")
    assert rule((1, 3, 2), stop=frozenset({3})).check([1, 2, 3, 1, 2, 3], 0) == (3, FinishReason.STOP)
    assert rule((2, 2, 3)).check([4, 4, 4, 4, 4, 4], 0) == (6, FinishReason.REPETITION), "(4 4) three times"


@pytest.fixture(scope="module")
def api() -> Iterator[Hosted]:
    with hosted(LogprobExecutor(echo())) as h:
        yield h
        h.assert_idle()


def complete(api: Hosted, **body: object) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 20, "return_token_ids": True, **body})


def test_a_completion_ends_at_the_repeated_pattern_whole_streamed_and_over_grpc(api: Hosted) -> None:
    asked = {"repetition_detection": {"max_pattern_size": 3, "min_count": 2}}
    choice = complete(api, **asked).json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == (
        [5, 6, 7, 5, 6, 7], "repetition", "repetition_detected")
    later = complete(api, min_tokens=7, **asked).json()["choices"][0]
    assert (len(later["token_ids"]), later["finish_reason"]) == (7, "repetition")
    lines = httpx.post(f"{api.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 20, "stream": True, "stream_interval": 4, **asked}).text.splitlines()
    assert '"finish_reason":"repetition"' in "".join(lines)
    responses = list(api.stub.Generate(build_request(token_ids=PROMPT, max_tokens=20, repetition_detection={
        "max_pattern_size": 3, "min_count": 2})))
    assert [t for r in responses for t in r.token_ids] == [5, 6, 7, 5, 6, 7]
    assert responses[-1].finish_reason == pb.FINISH_REASON_REPETITION
    assert responses[-1].WhichOneof("stop_reason") is None, "the finish reason says it: no stop string"
    with Client(f"127.0.0.1:{api.server.port}", timeout=30) as client:
        completion = client.generate(token_ids=PROMPT, max_tokens=20, repetition_detection={
            "max_pattern_size": 3, "min_count": 2})
    assert (completion.finish_reason, completion.stop_reason) == ("repetition", "repetition_detected")
    at_length = complete(api, max_tokens=6, **asked).json()["choices"][0]
    assert (at_length["finish_reason"], at_length["stop_reason"]) == ("length", None), "the length first, as vLLM's"
    assert api.stub.GetStats(pb.GetStatsRequest()).num_finished_repetition >= 3
    metrics = text_string_to_metric_families(httpx.get(f"{api.url}/metrics", timeout=10).text)
    ended = {s.labels["finished_reason"]: s.value for f in metrics if f.name == "nanoserve:request_success"
             for s in f.samples if s.name == "nanoserve:request_success_total"}
    assert ended["repetition"] >= 3
    rendered = httpx.post(f"{api.url}/v1/completions/render", timeout=30, json={"prompt": PROMPT, **asked}).json()
    assert rendered[0]["sampling_params"]["repetition_detection"] == {
        "max_pattern_size": 3, "min_pattern_size": 1, "min_count": 2}


@pytest.mark.parametrize("detection", [
    {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, {"max_pattern_size": 2, "min_count": 1},
    {"max_pattern_size": 2, "min_count": 2, "window": 4}, {"max_pattern_size": 1025, "min_count": 2}])
def test_what_vllm_refuses_is_refused_naming_it(api: Hosted, detection: dict) -> None:
    answer = complete(api, repetition_detection=detection)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "repetition_detection")


def test_off_at_max_pattern_size_zero_and_a_resumed_repetition_is_refused(api: Hosted) -> None:
    assert complete(api, repetition_detection={"min_count": 5}).json()["choices"][0]["finish_reason"] == "length"
    resumed = build_request(token_ids=PROMPT, max_tokens=20, repetition_detection={"max_pattern_size": 1,
                                                                                   "min_count": 2})
    resumed.resume.completion_token_ids.extend([5, 5])
    with pytest.raises(Exception, match="repeat a pattern"):
        list(api.stub.Generate(resumed))
