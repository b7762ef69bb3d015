"""Prometheus metrics, named as vLLM names its own under ``nanoserve:`` and labelled with the served model's id.

They cost the engine loop next to nothing. Gauges and counters are read at scrape time from the ``LoopStats`` the
loop publishes after each iteration. Histograms are bucket counts the loop thread adds to as it goes (``Metrics`` is
its ``LoopObserver``): two values a step, a few a request, and a step's inter-token gaps grouped by value, so the
cost per step does not grow with the batch. docs/metrics.md describes every metric.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from common.step import ExecutorInfo
from scheduler_svc.core.sequence import FinishReason
from scheduler_svc.engine.stats import LoopStats

PREFIX = "nanoserve:"
LABELS = ("model_name",)

# vLLM's buckets, so that its dashboards and alerts read these metrics alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM has no forward-time histogram; a GPU step takes milliseconds, a big prefill up to seconds.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25,
                        0.5, 1.0, 2.5, 5.0, 10.0)

# (name, help, value) of each gauge and counter; counters get prometheus' ``_total`` suffix.
GAUGES: tuple[tuple[str, str, Callable[[LoopStats], float]], ...] = (
    ("num_requests_running", "Sequences scheduled: decoding, or part-way through a chunked prefill.",
     lambda s: s.num_running),
    ("num_requests_waiting", "Sequences waiting for their prefill (preempted ones included).", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1.",
     lambda s: (s.num_blocks - s.num_free_blocks) / s.num_blocks if s.num_blocks else 0.0),
    ("executor_up", "1 while the executor serves, 0 while it is down or incompatible.", lambda s: int(s.executor_up)),
)
COUNTERS: tuple[tuple[str, str, Callable[[LoopStats], float]], ...] = (
    ("prompt_tokens", "Prompt tokens of the requests whose first token is out.", lambda s: s.num_prompt_tokens),
    ("generation_tokens", "Tokens generated.", lambda s: s.num_generation_tokens),
    ("prefix_cache_queries", "Tokens looked up in the prefix cache.", lambda s: s.num_prefix_cache_query_tokens),
    ("prefix_cache_hits", "Tokens found in the prefix cache.", lambda s: s.num_prefix_cache_hit_tokens),
    ("num_preemptions", "Sequences preempted (to be recomputed) for want of KV blocks.", lambda s: s.num_preemptions),
    ("executor_restarts", "Recoveries onto a new executor instance.", lambda s: s.num_executor_restarts),
)
# vLLM's speculative-decoding counters, only while --speculative is on.
SPEC_COUNTERS: tuple[tuple[str, str, Callable[[LoopStats], float]], ...] = (
    ("spec_decode_num_drafts", "Verifications of proposed tokens (one per sequence per step).",
     lambda s: s.num_spec_drafts),
    ("spec_decode_num_draft_tokens", "Tokens proposed.", lambda s: s.num_spec_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", lambda s: s.num_spec_accepted_tokens),
)
# request_success's finished_reason labels: vLLM's, "error" for an engine-side failure apart from a client's abort.
FINISHED: tuple[tuple[str, Callable[[LoopStats], int]], ...] = (
    (FinishReason.STOP.value, lambda s: s.num_finished_stop),
    (FinishReason.LENGTH.value, lambda s: s.num_finished_length),
    (FinishReason.ABORT.value, lambda s: s.num_aborted),
    (FinishReason.REPETITION.value, lambda s: s.num_finished_repetition),
    ("error", lambda s: s.num_failed),
)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    values = (m * 10**e for e in itertools.count() for m in (1, 2, 5))
    return tuple(itertools.takewhile(lambda v: v <= max_value, values))


class Buckets:
    """A histogram the loop thread fills and a scrape reads. It takes ``count`` equal observations in one call, which
    prometheus_client's Histogram cannot (one at a time, each under a lock: a cost per sequence every step). Only one
    thread writes; a scrape reads one snapshot of the counts, so its buckets always agree."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # One count per bound (value <= bound, above the previous one), and one for values above every bound.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
        cumulative = itertools.accumulate(list(self.counts))
        buckets = [(floatToGoString(b), n) for b, n in zip((*self.bounds, math.inf), cumulative, strict=True)]
        family = HistogramMetricFamily(PREFIX + name, documentation, labels=LABELS)
        family.add_metric(labels, buckets, self.sum)
        return family


class Metrics:
    """The engine loop's ``LoopObserver`` and a prometheus collector: register it once the loop runs."""

    def __init__(self, model_name: str, stats: Callable[[], LoopStats], info: Callable[[], ExecutorInfo]) -> None:
        """``stats``: the loop's latest published stats; ``info``: the executor's handshake, the latest one after a
        recovery."""
        self.labels = [model_name]
        self.stats = stats
        self.info = info
        max_model_len = info().max_model_len
        self.iteration_tokens = Buckets(ITERATION_TOKENS_BUCKETS)
        self.executor_step = Buckets(STEP_SECONDS_BUCKETS)
        self.time_to_first_token = Buckets(TTFT_BUCKETS)
        self.inter_token_latency = Buckets(ITL_BUCKETS)
        self.e2e_latency = Buckets(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Buckets(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Buckets(build_1_2_5_buckets(max_model_len))
        self.generation_tokens = Buckets(build_1_2_5_buckets(max_model_len))
        self.histograms = (
            ("iteration_tokens_total", "Tokens computed per plan (a multi-step decode's passes together).",
             self.iteration_tokens),
            ("executor_step_seconds", "The executor's forward time per plan, as it reports it.", self.executor_step),
            ("time_to_first_token_seconds", "Seconds from a request's arrival to a choice's first token.",
             self.time_to_first_token),
            ("inter_token_latency_seconds", "Seconds between a choice's successive outputs.", self.inter_token_latency),
            ("e2e_request_latency_seconds", "Seconds from a request's arrival to a choice's end.", self.e2e_latency),
            ("request_queue_time_seconds", "Seconds from a request's submission to its choice's first step.",
             self.queue_time),
            ("request_prompt_tokens", "Prompt tokens per ended choice.", self.prompt_tokens),
            ("request_generation_tokens", "Tokens generated per ended choice.", self.generation_tokens),
        )

    # The loop thread (LoopObserver).

    def step(self, num_tokens: int, forward_s: float) -> None:
        self.iteration_tokens.observe(num_tokens)
        self.executor_step.observe(forward_s)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def inter_tokens(self, seconds: float, count: int) -> None:
        self.inter_token_latency.observe(seconds, count)

    def finished(self, seconds: float, queued_s: float | None, prompt_tokens: int, generation_tokens: int) -> None:
        self.e2e_latency.observe(seconds)
        if queued_s is not None:
            self.queue_time.observe(queued_s)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)

    # A scrape (any thread).

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats(), self.labels
        for name, documentation, value in GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=LABELS)
            gauge.add_metric(labels, value(stats))
            yield gauge
        for name, documentation, value in (*COUNTERS, *(SPEC_COUNTERS if stats.speculative else ())):
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
            counter.add_metric(labels, value(stats))
            yield counter
        if stats.speculative:
            yield accepted_per_position(stats, labels)
        success = CounterMetricFamily(PREFIX + "request_success", "Choices ended, by finish reason.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in FINISHED:
            success.add_metric([*labels, reason], count(stats))
        yield success
        for name, documentation, buckets in self.histograms:
            yield buckets.family(name, documentation, labels)
        if stats.max_loras:
            yield lora_requests_info(stats)
        yield cache_config_info(self.info())


def cache_config_info(info: ExecutorInfo) -> GaugeMetricFamily:
    """vLLM's info gauge of its cache config (value 1, the config in the labels, no ``model_name``): the endpoint
    picker sizes its index of each pod's prefix cache from ``num_gpu_blocks`` and cuts prompts at ``block_size``.
    The blocks are the executor's whatever its device, the KV cache is in the model's dtype, and the prefix cache is
    always on."""
    labels = {"block_size": str(info.block_size), "cache_dtype": info.dtype, "enable_prefix_caching": "True",
              "num_gpu_blocks": str(info.num_blocks)}
    gauge = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the executor's KV cache.",
                              labels=list(labels))
    gauge.add_metric(list(labels.values()), 1)
    return gauge


def lora_requests_info(stats: LoopStats) -> GaugeMetricFamily:
    """vLLM's LoRA gauge, which the Gateway API Inference Extension's endpoint picker routes by: its labels say which
    adapters run and wait; its value is when they were read (seconds since the epoch), the picker taking the latest."""
    gauge = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters (in the labels).",
                              labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    gauge.add_metric([str(stats.max_loras), stats.running_lora_adapters, stats.waiting_lora_adapters], time.time())
    return gauge


def accepted_per_position(stats: LoopStats, labels: list[str]) -> CounterMetricFamily:
    """vLLM's per-position acceptance: accepted tokens by their position in the proposal (label ``position``, 0
    first); divided by ``spec_decode_num_drafts`` it is the acceptance rate at each position."""
    counter = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Proposed tokens accepted, by position in the proposal.",
                                  labels=[*LABELS, "position"])
    for position, count in enumerate(stats.spec_accepted_per_position):
        counter.add_metric([*labels, str(position)], count)
    return counter


def new_registry() -> CollectorRegistry:
    """A registry of one server's metrics, with the process and Python ones a default registry has."""
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    return registry
