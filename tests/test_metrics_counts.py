"""What the metrics count as vLLM's V1 counts it: a request part-way through a chunked prefill runs, a request an
engine-side failure ended finishes with "error", the LoRA gauge is there wherever adapters can be served, and the
cache-config gauge reports the executor's KV cache."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.step import ExecutorInfo
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.engine.admission import Admission, QueueLimits
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.live_requests import LiveRequests
from scheduler_svc.engine.metrics import Metrics
from scheduler_svc.engine.stats import LoopStats
from tests.service_fixtures import free_port, token_request
from tests.test_metrics import Samples, parse, value
from tests.test_reliability_recovery import FlakyExecutor, scheduler


def scraped(engine: Engine) -> Samples:
    """/metrics as the engine loop would publish it now, parsed."""
    metrics = Metrics("m", lambda: stats, lambda: engine.info)
    stats = LoopStats.of(engine, LiveRequests(Admission(QueueLimits()), metrics), executor_up=True)
    registry = CollectorRegistry()
    registry.register(metrics)
    return parse(generate_latest(registry).decode())


@pytest.mark.parametrize("policy", ["nano-vllm", "mixed"])
def test_a_prompt_part_way_through_its_chunked_prefill_counts_as_running(policy: str):
    engine = Engine(ShadowExecutor(num_blocks=128, block_size=16, max_model_len=2048),
                    SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, policy=policy))
    engine.enqueue(list(range(1, 1001)), SamplingParams(max_tokens=4))
    engine.enqueue([1, 2, 3], SamplingParams(max_tokens=4))
    scheduled, _ = engine.scheduler.schedule()
    assert [seq.num_scheduled_tokens for seq in scheduled] == [64]  # its first chunk only
    samples = scraped(engine)
    assert (value(samples, "num_requests_running"), value(samples, "num_requests_waiting")) == (1, 1)


def test_requests_an_executor_failure_ended_finish_with_error_not_abort():
    executor = FlakyExecutor()

    async def run() -> tuple[grpc.aio.AioRpcError, Samples]:
        async with scheduler(executor, metrics_port=free_port()) as s, httpx.AsyncClient() as http:
            executor.refuse_plans = True
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.GenerateOnce(token_request([1, 2, 3], 5))
            executor.refuse_plans = False
            url = f"http://127.0.0.1:{s.server.metrics_http.port}/metrics"
            return refused.value, parse((await http.get(url)).text)

    refused, samples = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.INTERNAL
    assert [value(samples, "request_success_total", finished_reason=r) for r in ("abort", "error")] == [0, 1]


class LoraReadyExecutor(ShadowExecutor):
    """An executor that can load adapters at run time, none loaded yet."""

    def get_info(self) -> ExecutorInfo:
        return replace(super().get_info(), max_lora_rank=8, runtime_lora=True)


def test_the_lora_gauge_is_there_with_runtime_lora_before_any_adapter_is_loaded():
    engine = Engine(LoraReadyExecutor(), SchedulerConfig(max_loras=2))
    samples = scraped(engine)
    labels = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert value(samples, "lora_requests_info", **labels) > 0
    assert not any(name == "nanoserve:lora_requests_info" for name, _ in scraped(Engine(ShadowExecutor())))


def cache_configs(samples: Samples) -> list[dict[str, str]]:
    return [dict(labels) for (name, labels), v in samples.items() if name == "nanoserve:cache_config_info" and v == 1]


def test_the_cache_config_info_gauge_has_vllms_labels_and_follows_an_executor_restart():
    """vLLM's vllm:cache_config_info, from whose labels the endpoint picker sizes its prefix index of each pod
    (cacheInfoSpec in deploy/kubernetes/base/epp.yaml)."""
    executor = FlakyExecutor(num_blocks=64, block_size=4)

    async def run() -> list[list[dict[str, str]]]:
        async with scheduler(executor, metrics_port=free_port()) as s, httpx.AsyncClient() as http:
            url = f"http://127.0.0.1:{s.server.metrics_http.port}/metrics"
            seen = [cache_configs(parse((await http.get(url)).text))]
            executor.restart(num_blocks=96, block_size=8)  # a new instance, another KV cache
            deadline = time.monotonic() + 10
            while (configs := cache_configs(parse((await http.get(url)).text))) == seen[0]:
                assert time.monotonic() < deadline, "the gauge never followed the restarted executor"
                await asyncio.sleep(0.02)
            return [*seen, configs]

    dtype = executor.get_info().dtype
    assert asyncio.run(run()) == [
        [{"block_size": "4", "num_gpu_blocks": "64", "cache_dtype": dtype, "enable_prefix_caching": "True"}],
        [{"block_size": "8", "num_gpu_blocks": "96", "cache_dtype": dtype, "enable_prefix_caching": "True"}]]
