"""Model-free executors over gRPC, so the whole stack runs and is tested without torch.

Modes:
- shadow (default): the shadow-KV executor, whose tokens expose any block-table bug;
- ``--echo``: each completion repeats its prompt, so tests can predict the exact text;
- ``--null``: a fixed token at once for every scheduled request, to measure scheduler + RPC overhead.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

from common.executor import Executor
from common.flags import boolean
from common.security import TLSConfig
from common.step import ExecutorInfo, StepPlan, StepResult
from executor_svc.core.request_table import RequestTable, ScheduledChunk
from executor_svc.core.step_pipeline import run_forward_passes
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.service import serve

NULL_TOKEN_ID = 1


def model_free_info(
    args: argparse.Namespace, model_id: str, tokenizer_json: str, chat_template: str, device: str = "cpu"
) -> ExecutorInfo:
    return ExecutorInfo(
        instance_id=uuid.uuid4().hex,
        model_id=model_id,
        architecture=model_id,
        dtype="int64",
        device=device,
        vocab_size=args.vocab_size,
        eos_token_ids=tuple(args.eos_token_ids),
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        tensor_parallel_size=1,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        attention_backend=model_id,
    )


class NullExecutor(Executor):
    """Answers every plan at once with NULL_TOKEN_ID per scheduled request; keeps no state."""

    def __init__(self, info: ExecutorInfo) -> None:
        self.info = info

    def get_info(self) -> ExecutorInfo:
        return self.info

    def step(self, plan: StepPlan) -> StepResult:
        cached = plan.cached_requests
        n = len(plan.new_requests) + (sum(cached.num_decode_steps) or len(cached.request_ids))
        return StepResult([NULL_TOKEN_ID] * n, instance_id=self.info.instance_id, step_id=plan.step_id)

    def reset(self) -> int:
        return 0


class EchoExecutor(Executor):
    """Completion token ``i`` is prompt token ``i mod len(prompt)``: a predictable text for stop-string tests.

    It remembers each request's prompt length for its lifetime (request ids are
    never reused), so a preempted request continues its echo when it returns.
    """

    def __init__(self, info: ExecutorInfo) -> None:
        self.info = info
        self.table = RequestTable(info.num_blocks, info.block_size, info.vocab_size, info.max_model_len)
        self.prompt_lens: dict[int, int] = {}

    def get_info(self) -> ExecutorInfo:
        return self.info

    def step(self, plan: StepPlan) -> StepResult:
        chunks = self.table.apply(plan)
        for new in plan.new_requests:
            self.prompt_lens.setdefault(
                new.request_id, len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens)
        result = run_forward_passes(self.table, chunks, self._echo)
        result.instance_id, result.step_id = self.info.instance_id, plan.step_id
        return result

    def _echo(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepResult:
        token_ids = []
        for chunk in chunks:
            tokens = chunk.state.token_ids
            n_prompt = self.prompt_lens[chunk.state.request_id]
            token_ids.append(tokens[(len(tokens) - n_prompt) % n_prompt] if chunk.samples else 0)
        return StepResult(token_ids)

    def reset(self) -> int:
        self.prompt_lens.clear()
        return self.table.reset()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m executor_svc.fakes.shadow_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50052, help="port to bind (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks to report (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=1000, help="token ids are below it (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="longest prompt + completion in tokens (default: %(default)s)")
    parser.add_argument("--eos-token-ids", type=lambda s: [int(t) for t in s.split(",") if t], default=[0],
                        help="comma-separated EOS token ids (default: 0)")
    parser.add_argument("--draft-miss-every", type=int,
                        help="give the shadow executor a draft model whose proposal is wrong after about one context "
                             "in this many (default: no draft model)")
    parser.add_argument("--tokenizer-json", type=Path, help="tokenizer.json to hand the scheduler (default: none)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: none)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--null", action="store_true", help="answer every request with a fixed token at once")
    mode.add_argument("--echo", action="store_true", help="complete each prompt with itself, repeated")
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key, serve TLS (default: plaintext)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA; clients must then present a certificate it signed (mutual TLS)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--yield-cpu", type=boolean, default=False,
                        help="run gRPC's threads in SCHED_IDLE, as nanoserve-executor's flag (default: off)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    tokenizer_json = args.tokenizer_json.read_text() if args.tokenizer_json else ""
    chat_template = args.chat_template.read_text() if args.chat_template else ""
    if args.null:
        executor = NullExecutor(model_free_info(args, "null", tokenizer_json, chat_template))
    elif args.echo:
        executor = EchoExecutor(model_free_info(args, "echo", tokenizer_json, chat_template))
    else:
        executor = ShadowExecutor(args.num_blocks, args.block_size, args.vocab_size, tuple(args.eos_token_ids),
                                  args.max_model_len, tokenizer_json, chat_template, args.draft_miss_every)
    serve(executor, args.host, args.port, tls=TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca),
          yield_helpers=args.yield_cpu)


if __name__ == "__main__":
    main()
