"""The shadow-KV test executor: a model-free oracle for the scheduler.

It writes token ids into the KV slots the plan names and derives each next
token from the context it reads back through the block table. A wrong block
table, a prefix-cache hit on the wrong content, a chunk at the wrong offset or
a lost token after preemption all change the context it reads, and so the
tokens it returns. ``reference_generate`` is the same function run on a plain
token list: what a correct scheduler must reproduce.

It verifies speculative proposals as the model executor does: a verification
chunk's last token and proposals go into their slots, each proposal is accepted
while it equals the token the context before it gives, and the first one that
does not (or the token after the last) is its own; the slots of rejected
proposals are emptied, so a scheduler that counted them as computed reads a
wrong context. With ``draft_miss_every`` it also has a "draft model": it
proposes the true next tokens except where a hash of the context says miss.

Prompt logprobs come from the same reading: its model gives ``next_token`` of the context probability ``HIT`` and
the rest of the vocabulary equal shares, and it scores the rows the model executor scores.
"""

from __future__ import annotations

import itertools
import math
import uuid

import numpy as np
import xxhash

from common.step import ExecutorInfo, PromptLogprobs, StepResult, TokenLogprobs
from executor_svc.core.request_table import RequestTable, ScheduledChunk
from executor_svc.core.step_pipeline import TableExecutor

EMPTY_SLOT = -1
# The probability the shadow's model gives its own next token (the rest is spread evenly over the vocabulary).
HIT = 0.9


def next_token(context: np.ndarray, vocab_size: int, seed: int | None) -> int:
    """A deterministic function of every token of the context (and the request's seed)."""
    h = xxhash.xxh64(context.astype(np.int64).tobytes(), seed=seed or 0)
    return h.intdigest() % vocab_size


def draft_token(context: list[int], vocab_size: int, seed: int | None, miss_every: int) -> int:
    """The shadow draft model's proposal after ``context``: ``next_token``, except in about one in ``miss_every``
    contexts (by a second hash), where it proposes the token after that one."""
    true = next_token(np.array(context), vocab_size, seed)
    miss = xxhash.xxh64(np.array(context, dtype=np.int64).tobytes(), seed=1).intdigest() % miss_every == 0
    return (true + 1) % vocab_size if miss else true


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
        draft_miss_every: int | None = None,
        queues: bool = False,
    ) -> None:
        super().__init__()
        # As on a GPU: a launch only queues the step (computed when finished), the step after it is launched from its
        # tokens or behind it (``TableExecutor.samples_ahead``), so the engine meets every order a device gives.
        self.queues = queues
        if draft_miss_every is not None and draft_miss_every < 1:
            raise ValueError(f"draft_miss_every must be >= 1, got {draft_miss_every}")
        self.table = RequestTable(num_blocks, block_size, vocab_size, max_model_len)
        self.table.verifies_drafts = True
        self.table.has_draft_model = draft_miss_every is not None
        self.draft_miss_every = draft_miss_every
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
            draft_model_id="" if draft_miss_every is None else f"shadow-draft-miss-1-in-{draft_miss_every}",
        )

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> object | None:
        """Queued, a step's input is its chunks, read when it is computed; a verification is packed at launch, as the
        model executor packs one (its proposals come then)."""
        return chunks if self.queues and not any(chunk.num_drafts for chunk in chunks) else None

    def launches_ahead(self, inputs: object | None) -> bool:
        return inputs is not None

    def fills_ahead(self, inputs: object | None) -> bool:
        return inputs is not None

    def samples_ahead(self, launched: object) -> bool:
        chunks, _ = launched
        return self.queues and not any(chunk.num_drafts for chunk in chunks)

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        bs = self.info.block_size
        return np.asarray(block_table, dtype=np.int64)[positions // bs] * bs + positions % bs

    def forward(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepResult:
        """Write each chunk's tokens into its KV slots, then derive each sampled token from the KV read back."""
        for chunk in chunks:
            if chunk.num_drafts and chunk.drafts is None:
                chunk.drafts = self.propose(chunk)
            self.kv[self._slots(chunk.state.block_table, chunk.start, chunk.end)] = chunk.input_tokens()
        token_ids: list[int] = []
        counts: list[int] = []
        rejected = []
        for chunk in chunks:
            sampled = self._verify(chunk) if chunk.num_drafts else [self._sample(chunk, chunk.end)]
            token_ids += sampled
            counts.append(len(sampled))
            if len(sampled) <= chunk.num_drafts:
                rejected.append(self._slots(chunk.state.block_table, chunk.start + len(sampled), chunk.end))
        for slots in rejected:
            self.kv[slots] = EMPTY_SLOT
        verified = any(chunk.num_drafts for chunk in chunks)
        scored = [run for chunk in chunks if (run := self._score_prompt(chunk)) is not None]
        return StepResult(token_ids, num_sampled_tokens=counts if verified else [], prompt_logprobs=scored)

    def _score_prompt(self, chunk: ScheduledChunk) -> PromptLogprobs | None:
        """Prompt logprobs as the model executor scores them (the rows of a prefill chunk whose next token is a
        prompt token), under the shadow's model: ``next_token`` of the context read back from the KV has
        probability ``HIT``, every other token the rest in equal parts, so a wrong context shows in the values."""
        state, vocab = chunk.state, self.info.vocab_size
        num_top, end = state.sampling.num_prompt_logprobs, min(chunk.end, state.num_prompt_tokens - 1)
        if num_top is None or chunk.start >= end:
            return None
        hit, miss = math.log(HIT), math.log((1 - HIT) / (vocab - 1))
        entries = []
        for position in range(chunk.start, end):
            context = self.kv[self._slots(state.block_table, 0, position + 1)]
            likeliest = next_token(context, vocab, state.sampling.seed)
            others = itertools.islice((t for t in range(vocab) if t != likeliest), max(0, min(num_top, vocab) - 1))
            top = [likeliest, *others][:num_top]
            entries.append(TokenLogprobs(hit if state.token_ids[position + 1] == likeliest else miss, top,
                                         [hit if t == likeliest else miss for t in top]))
        return PromptLogprobs(state.request_id, chunk.start + 1, entries)

    def _sample(self, chunk: ScheduledChunk, end: int) -> int:
        """The token after the first ``end`` tokens of the chunk's context, read back from the KV (0 for a chunk
        short of its request's end)."""
        if not chunk.samples:
            return 0
        context = self.kv[self._slots(chunk.state.block_table, 0, end)]
        return next_token(context, self.info.vocab_size, chunk.state.sampling.seed)

    def _verify(self, chunk: ScheduledChunk) -> list[int]:
        """The proposals the context accepts, in order, then the context's own next token."""
        out = []
        for j, draft in enumerate([*chunk.drafts, None]):
            token = self._sample(chunk, chunk.start + 1 + j)
            out.append(token)
            if token != draft:
                break
        return out

    def propose(self, chunk: ScheduledChunk) -> list[int]:
        """The draft model's ``num_drafts`` proposals after the chunk's last token."""
        context = chunk.state.token_ids[: chunk.start + 1]
        seed = chunk.state.sampling.seed
        for _ in range(chunk.num_drafts):
            context.append(draft_token(context, self.info.vocab_size, seed, self.draft_miss_every))
        return context[chunk.start + 1 :]
