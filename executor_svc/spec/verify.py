"""Sampling a step whose rows verify proposals: each position of a row in turn, as plain decoding would.

A verification row has logits at its last token and at each of its k proposals. Position j is sampled with the
row's full settings on the context as decoding would have it there (the tokens, then proposals 1..j): logits
processors and min_tokens read the proposals appended to the request for the while, the grammar matcher consumes
each accepted one, and the draw uses the sampler's position-keyed noise at that position. Proposal j + 1 is
accepted iff the token sampled at position j equals it; the first token that differs, or the one after the last
proposal, is the row's own and ends it. The emitted tokens are therefore exactly the tokens plain decoding samples
(seeded rows bit for bit, unseeded ones in distribution), whatever the proposals were: docs/executor.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.step import TokenLogprobs
from executor_svc.core.request_table import ScheduledChunk
from executor_svc.sample.constraints import GrammarConstraints
from executor_svc.sample.sampler import Sampler


@dataclass
class Verified:
    """Per chunk (in the order given): its tokens and, where asked, their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)


def verify(logits: torch.Tensor, chunks: list[ScheduledChunk], sampler: Sampler,
           constraints: GrammarConstraints) -> Verified:
    """Sample ``chunks`` (each of which samples) from ``logits``, whose rows are each chunk's sampled rows in order
    (``1 + num_drafts`` for a verification chunk, else 1); the requests' tokens are left as they came."""
    first = [0]
    for chunk in chunks:
        first.append(first[-1] + 1 + chunk.num_drafts)
    tokens: list[list[int]] = [[] for _ in chunks]
    logprobs: list[list[TokenLogprobs | None]] = [[] for _ in chunks]
    appended = [0] * len(chunks)
    asked = False
    alive = list(range(len(chunks)))
    j = 0
    try:
        while alive:
            rows = logits[torch.tensor([first[i] + j for i in alive], device=logits.device)]
            states = [chunks[i].state for i in alive]
            constrained = constraints.mask(rows, states)
            positions = [chunks[i].end - chunks[i].num_drafts + j for i in alive]
            output = sampler(rows, [state.sampling for state in states], positions, states)
            if constrained:
                constraints.advance(states, constrained, output.token_ids)
            asked = asked or bool(output.logprobs)
            entries = output.logprobs or [None] * len(alive)
            staying = []
            for i, token_id, entry in zip(alive, output.token_ids, entries, strict=True):
                tokens[i].append(token_id)
                logprobs[i].append(entry)
                chunk = chunks[i]
                if j < chunk.num_drafts and token_id == chunk.drafts[j]:
                    chunk.state.token_ids.append(token_id)  # the context of the next position
                    appended[i] += 1
                    staying.append(i)
            alive = staying
            j += 1
    finally:
        for chunk, n in zip(chunks, appended, strict=True):
            if n:
                state = chunk.state
                removed = state.token_ids[-n:]
                del state.token_ids[-n:]
                counts = state.token_counts
                if counts is not None and counts.num_tokens > len(state.token_ids):
                    counts.forget(removed[: counts.num_tokens - len(state.token_ids)])
    return Verified(tokens, logprobs if asked else [])
