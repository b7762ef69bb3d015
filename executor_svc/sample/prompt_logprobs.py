"""Prompt logprobs: each prompt token's log-probability given the tokens before it (vLLM's ``prompt_logprobs``).

A prefill chunk of a request that asks scores, besides its last row, every row whose next token is still a
prompt token: row ``p`` predicts token ``p + 1``. The rows go through the LM head with the sampled ones (so
tensor-parallel ranks gather the same rows), then a log_softmax gives the prompt token's own logprob and the
request's top alternatives. Logprobs describe the raw model, like the sampled tokens' (no temperature, no filter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.step import PromptLogprobs, TokenLogprobs
from executor_svc.core.request_table import ScheduledChunk
from executor_svc.sample.sampler import chosen_and_ranks


@dataclass(frozen=True)
class ScoredRun:
    """The rows ``[first_row, first_row + len(targets))`` of a step's extra logits score ``targets``, the prompt
    tokens from ``first_position`` on, of request ``request_id`` with ``num_top`` alternatives each."""

    request_id: int
    first_position: int
    first_row: int
    targets: list[int]
    num_top: int


def score_rows(chunks: list[ScheduledChunk], chunk_starts: list[int]) -> tuple[list[int], list[ScoredRun]]:
    """Packed-batch rows to score for prompt logprobs (``chunk_starts[i]``: chunk i's first row), and the runs."""
    rows: list[int] = []
    runs: list[ScoredRun] = []
    for chunk, row0 in zip(chunks, chunk_starts, strict=True):
        state = chunk.state
        num_top = state.sampling.num_prompt_logprobs
        end = min(chunk.end, state.num_prompt_tokens - 1)
        if num_top is None or chunk.start >= end:
            continue
        runs.append(ScoredRun(state.request_id, chunk.start + 1, len(rows), state.token_ids[chunk.start + 1 : end + 1],
                              num_top))
        rows += range(row0, row0 + end - chunk.start)
    return rows, runs


def prompt_logprobs(logits: torch.Tensor, runs: list[ScoredRun]) -> list[PromptLogprobs]:
    """The runs' logprobs from their rows of ``logits`` [scored rows, vocab]."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor([t for run in runs for t in run.targets], device=logits.device)
    chosen, ranks = chosen_and_ranks(logprobs, targets)
    top_values, top_ids = logprobs.topk(min(max(run.num_top for run in runs), logits.shape[1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for run in runs:
        n = run.num_top
        rows = range(run.first_row, run.first_row + len(run.targets))
        entries = [TokenLogprobs(chosen[r], top_ids[r][:n], top_values[r][:n], ranks[r]) for r in rows]
        out.append(PromptLogprobs(run.request_id, run.first_position, entries))
    return out
