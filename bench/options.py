"""What the sampling options cost: a decode step of N sequences with penalties and logit bias on every one, and
with a JSON-schema constraint on every one, against the plain step (in-process, CPU, the embedded model).

Each peer admits ``--batch`` requests of ``--context`` random prompt tokens, runs their prefills (untimed), then
times ``--steps`` decode steps of the whole batch through the scheduler ``Engine`` and the ``ModelExecutor``.
Rounds alternate between the peers (``--repeats``) and each peer's median step is reported, with its ratio to
the plain peer's: the targets are 1.05x (penalties and bias) and 1.15x (JSON schema).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from executor_svc.cpu.malloc import keep_heap_memory
from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()
keep_heap_memory()

from bench.common import print_table, progress, write_json  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions  # noqa: E402
from executor_svc.runtime.model_executor import ModelExecutor  # noqa: E402
from nanoserve.v1 import generation_pb2 as pb  # noqa: E402
from scheduler_svc.api.structured import compile_grammar  # noqa: E402
from scheduler_svc.core.sampling import SamplingParams  # noqa: E402
from scheduler_svc.core.tokenizer import ModelTokenizer  # noqa: E402
from scheduler_svc.engine.engine import Engine  # noqa: E402

# A small object schema whose completions stay short; with ignore_eos a finished one keeps sampling EOS, masked.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "maxItems": 3,
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age"]}
PEERS = ("plain", "penalties", "json_schema")


def peer_params(peer: str, steps: int, grammar: str) -> SamplingParams:
    base = {"temperature": 1.0, "seed": 1, "max_tokens": steps + 1, "ignore_eos": True}
    if peer == "penalties":
        bias = {token_id: (-100.0 if token_id % 2 else 5.0) for token_id in range(100, 108)}
        return SamplingParams(**base, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                              logit_bias=bias)
    if peer == "json_schema":
        return SamplingParams(**base, grammar=grammar)
    return SamplingParams(**base)


def decode_step_seconds(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> float:
    """The median wall time of one decode step of the whole batch, after its prefills."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.scheduler.waiting:  # the prefills
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.step()
    return statistics.median(times[1:steps])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.options", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding together (default: 64)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each (default: 256)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per round (default: 24)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per peer (default: 3)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    executor = ModelExecutor(ExecutorOptions(dtype=args.dtype, kv_cache_memory=1 << 30, threads=args.threads))
    engine = Engine(executor)
    tokenizer = ModelTokenizer.from_info(executor.get_info())
    info = executor.get_info()
    grammar = compile_grammar(pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), tokenizer, info.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randint(100, 10000) for _ in range(args.context)] for _ in range(args.batch)]
    engine.generate([prompts[0][:32]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seconds: dict[str, list[float]] = {peer: [] for peer in args.peers}
    with progress(total=args.repeats * len(args.peers), desc="rounds") as bar:
        for _ in range(args.repeats):
            for peer in args.peers:
                seconds[peer].append(decode_step_seconds(engine, prompts, peer_params(peer, args.steps, grammar),
                                                         args.steps))
                bar.update()
    medians = {peer: statistics.median(values) for peer, values in seconds.items()}
    plain = medians.get("plain")
    figures: dict[str, object] = {"batch": args.batch, "context": args.context, "dtype": args.dtype}
    rows = []
    for peer, median in medians.items():
        ratio = median / plain if plain else None
        figures[f"{peer}_step_ms"] = 1000 * median
        if ratio is not None:
            figures[f"{peer}_over_plain"] = ratio
        rows.append([peer, 1000 * median, " ".join(f"{1000 * s:.1f}" for s in seconds[peer]),
                     "-" if ratio is None else f"{ratio:.3f}"])
    print(f"decode step of {args.batch} sequences, context {args.context}, {args.dtype}, {args.threads} threads, "
          f"median of {args.repeats} rounds of {args.steps} steps")
    print_table(["peer", "ms per step", "rounds (ms)", "x plain"], rows)
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
