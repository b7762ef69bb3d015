"""The shadow-KV test executor: a model-free oracle for the scheduler.

It writes token ids into the KV slots the plan names and derives each next
token from the context it reads back through the block table. A wrong block
table, a prefix-cache hit on the wrong content, a chunk at the wrong offset or
a lost token after preemption all change the context it reads, and so the
tokens it returns. ``reference_generate`` is the same function run on a plain
token list: what a correct scheduler must reproduce.
"""

from __future__ import annotations

import uuid

import numpy as np
import xxhash

from common.step import ExecutorInfo, StepResult
from executor_svc.core.request_table import RequestTable, ScheduledChunk
from executor_svc.core.step_pipeline import TableExecutor

EMPTY_SLOT = -1


def next_token(context: np.ndarray, vocab_size: int, seed: int | None) -> int:
    """A deterministic function of every token of the context (and the request's seed)."""
    h = xxhash.xxh64(context.astype(np.int64).tobytes(), seed=seed or 0)
    return h.intdigest() % vocab_size


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    vocab_size: int,
    eos_token_ids: set[int] = frozenset(),
    ignore_eos: bool = False,
    seed: int | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """The tokens a correct engine returns for ``prompt`` on the shadow executor."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(np.array(tokens), vocab_size, seed)
        tokens.append(t)
        out.append(t)
        if (not ignore_eos and t in eos_token_ids) or len(out) >= max_tokens:
            return out
        if max_model_len is not None and len(tokens) >= max_model_len:
            return out


class ShadowExecutor(TableExecutor):
    """Implements the executor contract with token ids as its only 'KV'."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 16,
        vocab_size: int = 1000,
        eos_token_ids: tuple[int, ...] = (0,),
        max_model_len: int = 4096,
        tokenizer_json: str = "",
        chat_template: str = "",
    ) -> None:
        super().__init__()
        self.table = RequestTable(num_blocks, block_size, vocab_size, max_model_len)
        self.kv = np.full(num_blocks * block_size, EMPTY_SLOT, dtype=np.int64)
        self.info = ExecutorInfo(
            instance_id=uuid.uuid4().hex,
            model_id="shadow-kv",
            architecture="ShadowKV",
            dtype="int64",
            device="cpu",
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos_token_ids),
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            tensor_parallel_size=1,
            tokenizer_json=tokenizer_json,
            chat_template=chat_template,
            attention_backend="shadow",
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        bs = self.info.block_size
        return np.asarray(block_table, dtype=np.int64)[positions // bs] * bs + positions % bs

    def forward(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepResult:
        """Write each chunk's tokens into its KV slots, then derive each sampled token from the KV read back."""
        for chunk in chunks:
            state = chunk.state
            self.kv[self._slots(state.block_table, chunk.start, chunk.end)] = state.token_ids[
                chunk.start : chunk.end
            ]
        token_ids = []
        for chunk in chunks:
            if not chunk.samples:
                token_ids.append(0)
                continue
            context = self.kv[self._slots(chunk.state.block_table, 0, chunk.end)]
            token_ids.append(next_token(context, self.info.vocab_size, chunk.state.sampling.seed))
        return StepResult(token_ids)
