"""Prometheus /metrics after known workloads: gRPC and HTTP requests counted alike, on the HTTP port (behind the API
key) and on --metrics-port (open, and served with HTTP off); preemptions; an outage and an executor restart. Each
test ends with every KV block free."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.engine.metrics import Buckets, build_1_2_5_buckets
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import GatedExecutor, free_port, token_request
from tests.test_reliability_recovery import VOCAB, FlakyExecutor, expected_tokens, scheduler, tokens_of
from tests.test_service_options import echo

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
MODEL = "echo"


def parse(text: str) -> Samples:
    """nanoserve's samples by name and labels (``model_name`` left out: one model is served)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("nanoserve:"):
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                samples[sample.name, frozenset(labels.items())] = sample.value
    return samples


def scrape(url: str, **headers: str) -> Samples:
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[f"nanoserve:{name}", frozenset(labels.items())]


@pytest.fixture
def api() -> Iterator[tuple[Hosted, GatedExecutor, str]]:
    """The echo executor behind a gate, HTTP on, and --metrics-port; idle at the end. One decode step per plan, so
    that each token after a choice's first is an output of its own: the count of gaps between outputs is exact."""
    gate = GatedExecutor(echo())
    with hosted(gate, metrics_port=free_port(), num_scheduler_steps=1) as h:
        yield h, gate, f"http://127.0.0.1:{h.server.metrics_http.port}"
        h.assert_idle()


def test_buckets_count_each_value_at_its_bound_and_many_at_once():
    buckets = Buckets((0.1, 1.0))
    for v in (0.1, 0.5, 2.0):
        buckets.observe(v)
    buckets.observe(0.05, count=3)
    family = buckets.family("x", "x", [MODEL])
    counts = {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert counts == {"0.1": 4, "1.0": 5, "+Inf": 6} and buckets.sum == pytest.approx(2.75)
    assert build_1_2_5_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_a_known_workload_over_grpc_and_http_is_counted_exactly(api):
    h, gate, metrics_url = api
    usages: list[tuple[int, int]] = []
    client = h.openai()
    completion = client.completions.create(model=MODEL, prompt=[20, 21, 22, 23, 24], max_tokens=6)
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    once = h.stub.GenerateOnce(token_request([10, 11, 12], 4))
    stopped = h.stub.GenerateOnce(token_request([5, 6, 7, 8], 10, stop_token_ids=[7]))
    assert [completion.choices[0].finish_reason, chat.choices[0].finish_reason] == ["length", "length"]
    assert (once.finish_reason, stopped.finish_reason, list(stopped.token_ids)) == (
        pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, [5, 6, 7])
    usages += [(u.prompt_tokens, u.completion_tokens) for u in (completion.usage, chat.usage, once.usage,
                                                                 stopped.usage)]
    # Aborted by the client once it has its first token: the gate holds the loop so the Abort lands mid-stream.
    request = token_request([30, 31, 32], 200, ignore_eos=True)
    request.request_id = "to-abort"
    call = h.stub.Generate(request)
    responses = [next(call)]
    gate.open.clear()
    assert h.stub.Abort(pb.AbortRequest(request_ids=["to-abort"])).aborted_request_ids == ["to-abort"]
    gate.open.set()
    responses += list(call)
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    usages.append((responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens))
    h.assert_idle()

    stats, samples = h.server.frontend.stats(), scrape(h.url)
    prompt, generated = sum(p for p, _ in usages), sum(c for _, c in usages)
    assert [value(samples, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort")] == [
        1, 3, 1]
    assert value(samples, "prompt_tokens_total") == prompt and value(samples, "generation_tokens_total") == generated
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(samples, f"{histogram}_count") == 5, histogram
    # One gap between each choice's successive tokens (one token per step).
    assert value(samples, "inter_token_latency_seconds_count") == generated - 5
    assert value(samples, "request_prompt_tokens_sum") == prompt
    assert value(samples, "request_generation_tokens_sum") == generated
    assert value(samples, "iteration_tokens_total_count") == stats.num_steps > 0
    assert value(samples, "executor_step_seconds_count") == stats.num_steps
    assert value(samples, "iteration_tokens_total_sum") >= prompt + generated - 5 - stats.num_prefix_cache_hit_tokens
    assert value(samples, "prefix_cache_hits_total") == stats.num_prefix_cache_hit_tokens
    assert value(samples, "prefix_cache_queries_total") >= prompt
    assert value(samples, "num_preemptions_total") == 0 and value(samples, "executor_restarts_total") == 0
    assert [value(samples, g) for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                        "executor_up")] == [0, 0, 0, 1]
    assert scrape(metrics_url) == samples


def test_n_choices_count_one_request_and_one_prompt_each(api):
    """As vLLM's n child requests: the prompt counter and the prompt histogram both count each choice's prompt
    (usage counts it once)."""
    h, _, _ = api
    reply = h.openai().completions.create(model=MODEL, prompt=[20, 21, 22], max_tokens=4, n=3)
    h.assert_idle()
    samples = scrape(h.url)
    assert value(samples, "request_success_total", finished_reason="length") == 3
    assert value(samples, "time_to_first_token_seconds_count") == 3
    assert reply.usage.prompt_tokens == 3
    assert value(samples, "prompt_tokens_total") == value(samples, "request_prompt_tokens_sum") == 3 * 3
    assert value(samples, "generation_tokens_total") == reply.usage.completion_tokens == 12


def test_metrics_need_no_api_key_on_either_port_and_the_metrics_port_serves_nothing_else():
    # As vLLM's --api-key leaves /metrics open: the endpoint picker scrapes the pool's port and sends no key.
    with hosted(echo(), api_key="s3cret", metrics_port=free_port()) as h:
        assert httpx.get(f"{h.url}/v1/models").status_code == 401
        samples = scrape(h.url)
        assert value(samples, "executor_up") == 1
        metrics_url = f"http://127.0.0.1:{h.server.metrics_http.port}"
        assert scrape(metrics_url) == samples
        assert httpx.get(f"{metrics_url}/v1/models").status_code == 404
        h.assert_idle()


def test_preemptions_are_counted_and_their_recompute_is_no_prefix_cache_query():
    """As vLLM's: a preempted sequence's lookups at its recompute are not prefix-cache queries (nor hits)."""
    prompts = [[i, 2, 3, i + 4] for i in range(1, 7)]
    # 16 blocks of 4 tokens; six sequences of 24 tokens need 36 at their longest.
    with hosted(ShadowExecutor(num_blocks=16, block_size=4, vocab_size=VOCAB)) as h:
        calls = [h.stub.Generate(token_request(p, 20, ignore_eos=True)) for p in prompts]
        tokens = [[t for r in call for t in r.token_ids] for call in calls]
        h.assert_idle()
        stats, samples = h.server.frontend.stats(), scrape(h.url)
    assert tokens == [reference_generate(p, 20, VOCAB, {0}, ignore_eos=True) for p in prompts]
    assert value(samples, "num_preemptions_total") == stats.num_preemptions > 0
    assert value(samples, "request_success_total", finished_reason="length") == 6
    assert value(samples, "generation_tokens_total") == 6 * 20
    assert value(samples, "prefix_cache_queries_total") == sum(map(len, prompts))
    assert value(samples, "prefix_cache_hits_total") == 0


def test_an_outage_turns_executor_up_to_0_and_only_a_new_instance_counts_as_a_restart():
    """With HTTP off: --metrics-port alone serves the metrics."""
    executor = FlakyExecutor(num_blocks=256)
    executor.step_delay_s = 0.005
    prompts = [[1, 2, 3], [4, 5, 6]]

    async def run() -> tuple[list[list[int]], list[tuple[float, float]]]:
        async with scheduler(executor, metrics_port=free_port()) as s, httpx.AsyncClient() as http:
            url = f"http://127.0.0.1:{s.server.metrics_http.port}/metrics"
            seen: list[tuple[float, float]] = []

            async def until_up(up: int) -> None:
                deadline = time.monotonic() + 10
                while value(samples := parse((await http.get(url)).text), "executor_up") != up:
                    assert time.monotonic() < deadline, f"executor_up never became {up}"
                    await asyncio.sleep(0.02)
                seen.append((up, value(samples, "executor_restarts_total")))

            calls = [s.stub.Generate(token_request(p, 200, ignore_eos=True)) for p in prompts]
            firsts = [list((await call.read()).token_ids) for call in calls]
            executor.down = True  # then back as the same instance: an outage, not a restart
            await until_up(0)
            executor.down = False
            await until_up(1)
            executor.down = True
            await until_up(0)
            executor.restart()
            await until_up(1)
            return [await tokens_of(c, f) for c, f in zip(calls, firsts, strict=True)], seen

    tokens, seen = asyncio.run(run())
    assert seen == [(0, 0), (1, 0), (0, 0), (1, 1)]
    assert tokens == [expected_tokens(p, 200) for p in prompts]
