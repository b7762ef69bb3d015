"""A recorded session for the replay tests: the real scheduler, in process, over an executor that restarts once,
serving requests that need chunked prefill, prefix hits, preemptions, n > 1, structured output, logprobs and a
resumed stream."""

from __future__ import annotations

import asyncio
import random
import time
from argparse import Namespace
from pathlib import Path

from common.executor import Executor
from common.recording import Recording
from common.replay import Replayer, ReplayReport
from common.replay_cli import recorded_executor
from common.step import ExecutorInfo
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.engine.stats import LoopStats
from tests.service_fixtures import (
    GatedExecutor,
    InProcess,
    assert_idle_async,
    collect,
    in_process_scheduler,
    token_request,
)

# Small steps and a small cache: prompts are chunked, and the requests in flight together do not fit.
SESSION_CONFIG = {"max_num_batched_tokens": 16, "max_num_seqs": 6}
# Small enough that the first wave's three prompts (26 blocks at their longest) preempt whenever they overlap: at 28
# blocks a loaded machine spread their arrivals and the session once recorded no preemption.
NUM_BLOCKS = 20
BLOCK_SIZE = 4
# The session's first wave: its requests, submitted to the engine loop (which takes them all in before the step after
# the one held); how long a held step waits for the requests it is held for, at most.
FIRST_WAVE = 6
HOLD_TIMEOUT_S = 10.0
# The preempting pair's prompts take 8 blocks each, and 12 each with their completions: 16 of 20 blocks, then 24.
PAIR_PROMPT, PAIR_COMPLETION = 30, 16


def prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(length)]


def greedy(token_ids: list[int], max_tokens: int, **stopping: object) -> pb.GenerateRequest:
    """Greedy: an unseeded sampled request draws from the executor's own generator, which no replay repeats."""
    request = token_request(token_ids, max_tokens, **stopping)
    request.sampling.temperature = 0
    return request


async def session(stub, vocab: int, regex: str, logprobs: bool) -> list[list[int]]:
    """The requests, in two waves (``logprobs``: one asks for them, of its tokens and its prompt's); every
    completion's tokens."""
    rng = random.Random(3)
    shared = prompt(rng, vocab, 17)
    first = [
        greedy(shared + prompt(rng, vocab, 23), 10, ignore_eos=True),  # chunked: 40 tokens, 16 a step
        greedy(prompt(rng, vocab, 9), 12, ignore_eos=True),
        greedy(prompt(rng, vocab, 11), 14, ignore_eos=True),
    ]
    choices = token_request(prompt(rng, vocab, 7), 8, ignore_eos=True)
    choices.sampling.n, choices.sampling.seed, choices.sampling.temperature = 3, 5, 0.8
    constrained = greedy(prompt(rng, vocab, 6), 6)
    constrained.structured_output.regex = regex
    scored = greedy(prompt(rng, vocab, 8), 9, ignore_eos=True)
    if logprobs:
        scored.sampling.logprobs, scored.prompt_logprobs = 2, 1
    streamed = [choices, constrained]
    whole = [*first, scored]
    outputs = await asyncio.gather(*(stub.GenerateOnce(r) for r in whole),
                                   *(collect_stream(stub, r) for r in streamed))
    resumed = greedy(prompt(rng, vocab, 10), 9, ignore_eos=True)
    resumed.resume.completion_token_ids.extend(prompt(rng, vocab, 3))
    again = shared + prompt(rng, vocab, 5)
    second = [greedy(again, 7, ignore_eos=True), resumed]  # a prefix hit, unless the first wave evicted it
    outputs += await asyncio.gather(*(stub.GenerateOnce(r) for r in second))
    outputs.append(await stub.GenerateOnce(greedy(again, 7, ignore_eos=True)))  # a prefix hit whatever the timing
    return [list(o.token_ids) if isinstance(o, pb.GenerateResponse) else o for o in outputs]


async def collect_stream(stub, request: pb.GenerateRequest) -> list[int]:
    responses = [r async for r in stub.Generate(request)]
    by_choice: dict[int, list[pb.GenerateResponse]] = {}
    for response in responses:
        by_choice.setdefault(response.index, []).append(response)
    return [t for index in sorted(by_choice) for t in collect(by_choice[index]).token_ids]


def record_session(executor: Executor, directory: Path, regex: str, vocab: int, logprobs: bool = False,
                   **config: object) -> tuple[list[list[int]], LoopStats]:
    """Run the session with ``--record directory``; its outputs and the engine loop's counters."""

    gate = GatedExecutor(executor)

    async def main():
        async with in_process_scheduler(gate, record=str(directory), **SESSION_CONFIG, **config) as s:
            # The first step waits until the first wave is in: on a loaded machine its arrivals spread, and a prompt
            # that ended before the next one came preempted nothing (the session once recorded no preemption).
            gate.open.clear()
            running = asyncio.ensure_future(session(s.stub, vocab, regex, logprobs))
            await until_held(s, FIRST_WAVE, running)
            gate.open.set()
            outputs = await running
            outputs += await preempting_pair(s, gate, vocab)
            await assert_idle_async(s.stub)
            return outputs, s.server.loop.stats

    return asyncio.run(main())


async def until_held(s: InProcess, num_requests: int, running: asyncio.Future) -> None:
    """Wait until the frontend holds ``num_requests`` requests (or ``running`` ends, or the timeout passes)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while (not running.done() and time.monotonic() < deadline
           and len(s.server.frontend.by_request_id) < num_requests):
        await asyncio.sleep(0.005)


async def preempting_pair(s: InProcess, gate: GatedExecutor, vocab: int) -> list[list[int]]:
    """Two requests whose prompts fit the cache together and whose completions do not, run side by side whatever the
    timing: the first one's first step is held until both are in. The waves before preempt too, as a rule, but how
    often depends on when their requests arrived (a loaded machine once recorded none)."""
    rng = random.Random(4)
    pair = [greedy(prompt(rng, vocab, PAIR_PROMPT), PAIR_COMPLETION, ignore_eos=True) for _ in range(2)]
    gate.open.clear()
    running = asyncio.gather(*(s.stub.GenerateOnce(r) for r in pair))
    await until_held(s, len(pair), running)
    gate.open.set()
    return [list(o.token_ids) for o in await running]


def replay(recording: Path, executor: Executor) -> ReplayReport:
    return Replayer(executor).run(Recording(recording))


def model_args(model: str, kv_cache_memory: int) -> Namespace:
    """``nanoserve replay --model`` arguments, on the CPU with the test's threads."""
    return Namespace(model=model, dtype=None, device="cpu", kv_cache_memory=kv_cache_memory, attention_backend=None,
                     threads=2)


def recorded(directory: Path) -> ExecutorInfo:
    return recorded_executor(Recording(directory))
