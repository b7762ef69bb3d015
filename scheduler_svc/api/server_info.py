"""What a gateway or a person asks a running scheduler about itself: the engine, the model, its KV cache, how it
schedules, and how loaded it is now. One plain record, read by HTTP ``/server_info`` and the VllmEngine service's
GetServerInfo and GetLoads, so both say the same."""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from scheduler_svc.engine.loop import EngineLoop

ENGINE = "nanoserve"


def engine_version() -> str:
    """The installed nanoserve's version ("unknown" when run from a source tree that was never installed)."""
    try:
        return version(ENGINE)
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ServerInfo:
    engine: str
    version: str
    # The executor's model id (vLLM's model path), and the name answers report it by (--served-model-name's first).
    model: str
    served_model_name: str
    architecture: str
    dtype: str
    device: str
    # Tokens per KV block and KV blocks in the executor's cache.
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int
    # How the scheduler runs steps (--max-num-seqs, --max-num-batched-tokens, --num-scheduler-steps,
    # --scheduling-policy, --overlap).
    max_num_seqs: int
    max_num_batched_tokens: int
    num_scheduler_steps: int
    scheduling_policy: str
    overlap: bool
    executor_instance_id: str
    # Now: what waits to be scheduled (the requests in flight, counted as they arrive, that no step has scheduled yet,
    # or the sequences waiting as of the last step, preempted ones included, whichever is more), the sequences
    # scheduled (as of the last step: decoding, or part-way through a chunked prefill, as vLLM counts them running),
    # KV blocks held by requests, prompt tokens of the requests that produced nothing yet (prefix-cache hits
    # included).
    num_waiting: int
    num_running: int
    num_used_blocks: int
    num_queued_prompt_tokens: int
    # Since start: the share of prompt tokens looked up in the prefix cache that were found there (each sequence's
    # first lookup: a preempted or requeued one's recompute is left out, as vLLM leaves it out).
    prefix_cache_hit_rate: float
    # Share of the KV blocks requests hold, in [0, 1].
    kv_cache_usage: float
    uptime_s: float


def server_info(loop: EngineLoop, started_at: float, num_requests: int, served_model_name: str = "") -> ServerInfo:
    """``started_at``: time.time() when the scheduler started; ``num_requests``: requests in flight now, the engine
    loop's or still on their way to it, so that the queue shows at once even while a step holds the loop;
    ``served_model_name``: "" for the executor's model id."""
    info, engine, stats = loop.info, loop.engine, loop.stats
    config = engine.config
    return ServerInfo(
        engine=ENGINE, version=engine_version(), model=info.model_id,
        served_model_name=served_model_name or info.model_id, architecture=info.architecture, dtype=info.dtype,
        device=info.device, block_size=info.block_size, num_kv_blocks=info.num_blocks,
        max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        tensor_parallel_size=info.tensor_parallel_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, num_scheduler_steps=config.num_scheduler_steps,
        scheduling_policy=config.policy, overlap=engine.overlap, executor_instance_id=info.instance_id,
        num_waiting=max(stats.num_waiting, num_requests - stats.num_running), num_running=stats.num_running,
        num_used_blocks=stats.num_blocks - stats.num_free_blocks, num_queued_prompt_tokens=loop.admission.num_tokens,
        prefix_cache_hit_rate=stats.num_prefix_cache_hit_tokens / max(1, stats.num_prefix_cache_query_tokens),
        kv_cache_usage=(stats.num_blocks - stats.num_free_blocks) / stats.num_blocks if stats.num_blocks else 0.0,
        uptime_s=time.time() - started_at,
    )
