"""W3's load and its figures: Poisson arrivals, streamed requests over gRPC or OpenAI's HTTP, and what they measure.

Every peer gets the same arrivals (``arrivals``: a seeded draw, as offsets from the run's start) so that peers run
in turn differ only in the server. The figures are vLLM's serving benchmark's: TTFT (send to first token), TPOT
(mean gap between a request's tokens after the first), ITL (every gap between streamed chunks after the first,
pooled over requests), percentiles by linear interpolation; and whether the server kept up with the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import openai

from bench.common import Workload, percentile, progress
from client.api import AsyncClient
from client.errors import NanoserveError

# A peer kept up with an offered rate when it completed requests at least this fast relative to their arrivals.
KEPT_UP = 0.95
# A server that keeps up holds a steady number of requests in flight (Little's law); one that does not piles them up
# at the rate arrivals outrun completions. Between the third quarter's arrivals and the last quarter's (a quarter of
# the requests apart) the mean in flight may grow by at most this share of those arrivals (completions at three
# quarters of their pace, or faster), plus IN_FLIGHT_SLACK requests for a short draw's noise. Absolute, not relative
# to the third quarter's count: a server already piled up by then grows by a smaller factor while it falls behind
# as fast. The third quarter, not the second: where one request takes a large share of a short run, a server that
# keeps up may still be filling up in the second.
IN_FLIGHT_GROWTH = 0.25
IN_FLIGHT_SLACK = 2
QUANTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, ``sent_s`` from the run's start, the rest from its send."""

    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    sent_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # the gaps between its streamed chunks after the first
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between output tokens after the first; None for a single token."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


class _Chunks:
    """Times a request's streamed chunks that carry tokens: the first sets TTFT, each later one adds an ITL gap."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = self.last = time.perf_counter()
        self.first = True

    def arrived(self) -> None:
        now = time.perf_counter()
        if self.first:
            self.result.ttft_s = now - self.start
            self.first = False
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now

    def ended(self) -> None:
        self.result.latency_s = time.perf_counter() - self.start


async def send(client: AsyncClient, prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
    """One streamed gRPC Generate."""
    result = RequestResult()
    chunks = _Chunks(result)
    try:
        async for chunk in client.stream(token_ids=prompt, max_tokens=max_tokens, temperature=temperature,
                                         ignore_eos=True):
            if chunk.token_ids:
                chunks.arrived()
                result.output_tokens += len(chunk.token_ids)
    except NanoserveError as e:
        result.error = str(e)
    chunks.ended()
    return result


async def send_openai(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                      temperature: float) -> RequestResult:
    """One streamed /v1/completions; the output tokens are the last chunk's usage."""
    result = RequestResult()
    chunks = _Chunks(result)
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if chunk.choices and (chunk.choices[0].text or getattr(chunk.choices[0], "token_ids", None)):
                chunks.arrived()
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        result.error = str(e)
    chunks.ended()
    return result


Send = Callable[[list[int], int, float], Awaitable[RequestResult]]


@contextlib.asynccontextmanager
async def grpc_backend(target: str) -> AsyncIterator[Send]:
    async with AsyncClient(target) as client:
        await client.health()
        yield functools.partial(send, client)


@contextlib.asynccontextmanager
async def openai_backend(base_url: str) -> AsyncIterator[Send]:
    """The served model is the first that /v1/models lists; no retries, so a refusal counts as failed."""
    api_key = os.environ.get("OPENAI_API_KEY", "none")
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        yield functools.partial(send_openai, client, model)


def arrivals(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times of ``n`` requests in seconds from the first: exponential gaps drawn from ``seed`` (all at 0 for
    inf), so that every peer and round gets the same arrivals, scaled as ``vllm bench serve`` scales its own so that
    they come at ``request_rate`` exactly (the last at (n - 1) / rate): a short draw's own rate strays far from it."""
    gaps = random.Random(seed)
    times, at = [], 0.0
    for i in range(n):
        if i and math.isfinite(request_rate):
            at += gaps.expovariate(request_rate)
        times.append(at)
    if at > 0:
        times = [t * (n - 1) / request_rate / at for t in times]
    return times


async def run_load(backend: contextlib.AbstractAsyncContextManager[Send], workload: Workload, request_rate: float,
                   seed: int, label: str = "") -> tuple[list[RequestResult], float]:
    """Send every request of ``workload`` at its arrival; return the results and the wall seconds."""
    times = arrivals(len(workload), request_rate, seed)
    async with backend as send_one:
        bar = progress(total=len(workload), desc=f"W3 {label or workload.name} @ {request_rate} req/s")
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter() - start
            result = await send_one(prompt, max_tokens, workload.temperature)
            result.sent_s = sent
            if result.error is None:
                result.error = short_of(result, max_tokens)
            bar.update()
            return result

        results = await asyncio.gather(*(one(p, m, at) for p, m, at in
                                         zip(workload.prompts, workload.max_tokens, times, strict=True)))
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def short_of(result: RequestResult, max_tokens: int) -> str | None:
    """Why a stream that ended without an error still failed: EOS is ignored, so a whole answer has every token."""
    if result.output_tokens != max_tokens:
        return f"the stream ended after {result.output_tokens} of {max_tokens} tokens"
    return None


def rate_over(times: Sequence[float]) -> float | None:
    """Events per second between the first and the last of ``times``; None for fewer than two or no span."""
    if len(times) < 2 or max(times) <= min(times):
        return None
    return (len(times) - 1) / (max(times) - min(times))


def in_flight_growth(results: Sequence[RequestResult]) -> tuple[float, float] | None:
    """The mean number of requests in flight at the arrivals of the third quarter of the run and of the last
    quarter; None for fewer than eight requests. Completions alone cannot tell: a server that falls behind batches
    what piled up and finishes it together, so its completions come as fast as the arrivals did."""
    if len(results) < 8:
        return None
    sends = sorted(r.sent_s for r in results)
    ends = sorted(r.sent_s + r.latency_s for r in results)

    def mean_in_flight(quarter: Sequence[float]) -> float:
        return sum(sum(s <= t for s in sends) - sum(e <= t for e in ends) for t in quarter) / len(quarter)

    n = len(sends)
    return mean_in_flight(sends[n // 2 : 3 * n // 4]), mean_in_flight(sends[3 * n // 4 :])


def piled_up(in_flight: tuple[float, float], num_requests: int) -> bool:
    """Whether the mean in flight grew from the third quarter's arrivals to the last's by more than
    ``IN_FLIGHT_GROWTH`` of the quarter's arrivals, plus ``IN_FLIGHT_SLACK``."""
    return in_flight[1] - in_flight[0] > IN_FLIGHT_GROWTH * num_requests / 4 + IN_FLIGHT_SLACK


def kept_up(offered: float | None, achieved: float | None, failed: int,
            in_flight: tuple[float, float] | None = None, num_requests: int = 0) -> bool | None:
    """Whether completions kept pace with arrivals: none failed, ``achieved >= KEPT_UP * offered``, and the
    ``num_requests`` did not pile up (``in_flight_growth``, ``piled_up``); None when the offered rate is not a rate
    (all at once, or one request)."""
    if offered is None:
        return None
    steady = in_flight is None or not piled_up(in_flight, num_requests)
    return failed == 0 and achieved is not None and achieved >= KEPT_UP * offered and steady


def saturation_point(kept: dict[float, bool | None]) -> float | None:
    """The highest offered rate a peer kept up with, counting up from the lowest and stopping at its first miss
    (a rate above one it could not keep up with does not count); None when it kept up with none."""
    best = None
    for rate in sorted(kept):
        if kept[rate] is None:
            continue
        if not kept[rate]:
            break
        best = rate
    return best


def summarise(results: list[RequestResult], duration_s: float, request_rate: float) -> dict[str, float | None]:
    """The run's figures: throughput, TTFT / TPOT / ITL / end-to-end percentiles in ms, and whether it kept up.

    ``offered_req_s`` is the rate the arrivals had (requests over the span of their sends, so a short Poisson draw
    is judged by what it sent, not by its nominal rate), ``achieved_req_s`` the same over the span of the
    completions."""
    done = [r for r in results if r.error is None]
    series = {
        "ttft": [1e3 * r.ttft_s for r in done if r.output_tokens],
        "tpot": [1e3 * r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [1e3 * gap for r in done for gap in r.itl_s],
        "e2e": [1e3 * r.latency_s for r in done],
    }
    output_tokens = sum(r.output_tokens for r in done)
    offered = rate_over([r.sent_s for r in results]) if math.isfinite(request_rate) else None
    achieved = rate_over([r.sent_s + r.latency_s for r in done])
    in_flight = in_flight_growth(done) if len(done) == len(results) else None
    figures: dict[str, float | None] = {
        "request_rate": request_rate if math.isfinite(request_rate) else None,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_tok_s": output_tokens / duration_s,
        "output_tokens": output_tokens,
        "offered_req_s": offered,
        "achieved_req_s": achieved,
        "in_flight_q3": in_flight[0] if in_flight else None,
        "in_flight_q4": in_flight[1] if in_flight else None,
        "kept_up": kept_up(offered, achieved, len(results) - len(done), in_flight, len(results)),
    }
    for name, values in series.items():
        figures[f"{name}_mean_ms"] = sum(values) / len(values) if values else 0.0
        for q in QUANTILES:
            figures[f"{name}_p{q}_ms"] = percentile(values, q)
    return figures
