"""``python -m executor_svc.runtime.replay``: ``nanoserve replay --shadow`` or ``--model`` (docs/replay.md), the
executor built in this process and driven with the recorded plans as the scheduler hands them to an in-process
executor: plain ``common.step`` objects, no protobuf in between."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.executor import Executor
from common.recording import RecordingError
from common.replay_cli import build_parser, open_recording, recorded_executor, refuse, replay
from common.step import ExecutorInfo

if TYPE_CHECKING:  # torch is imported only when a model is replayed
    from executor_svc.runtime.model_executor import ModelExecutor

# Dtypes a model executor runs; a recording made on another executor (the shadow's int64) leaves the choice to it.
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def shadow_executor(recorded: ExecutorInfo) -> Executor:
    """The shadow-KV executor with the recorded KV geometry, vocabulary and EOS."""
    from executor_svc.fakes.shadow import ShadowExecutor

    return ShadowExecutor(recorded.num_blocks, recorded.block_size, recorded.vocab_size, recorded.eos_token_ids,
                          recorded.max_model_len)


def model_executor(recorded: ExecutorInfo, args: argparse.Namespace) -> ModelExecutor:
    """The model in ``args.model``, with the recorded block size, length and (unless --dtype) dtype."""
    from executor_svc.runtime.config import ExecutorOptions
    from executor_svc.runtime.model_executor import ModelExecutor

    dtype = args.dtype or (recorded.dtype if recorded.dtype in MODEL_DTYPES else None)
    return ModelExecutor(ExecutorOptions(
        model=args.model, device=args.device, dtype=dtype, block_size=recorded.block_size,
        kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
        max_model_len=recorded.max_model_len, threads=args.threads,
    ))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser("nanoserve replay")
    args = parser.parse_args(argv)
    if args.executor:
        parser.error("--executor is the client's (nanoserve replay); this process builds --shadow or --model")
    try:
        recording = open_recording(args)
        recorded = recorded_executor(recording)
    except RecordingError as e:
        return refuse(e)
    if args.shadow:
        return replay(shadow_executor(recorded), recording, args)
    executor = model_executor(recorded, args)
    try:
        return replay(executor, recording, args)
    finally:
        executor.close()  # its tensor-parallel workers, if any


if __name__ == "__main__":
    sys.exit(main())
