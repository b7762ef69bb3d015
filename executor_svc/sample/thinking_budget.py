"""vLLM's ``thinking_token_budget``: once a request has thought for its budget, ``</think>`` is the only token left.

A request thinks from its last ``<think>`` with no ``</think>`` after it, the prompt's tokens included (a template
that opens the thinking in the prompt, as DeepSeek-R1's does, starts the count there, as vLLM's does); once that
many tokens followed the start, its row's logits are -inf but at the end marker, so greedy and sampled rows alike
take it and the model answers. Its logprob is read from the raw logits, as every logprob here: the model's own. A
later ``<think>`` starts a new count. A request whose grammar already applies (from its first token, in a prompt
that opened a thinking) is left to its grammar: a forced ``</think>`` would break it.

Each request's place is kept on its state (``ThinkingCount``) and advanced over the tokens appended since its last
sample, so a step's work does not grow with the context; tokens taken back (a verification's proposals) make it
read the request again from the start. A request that comes back (preemption, an executor restart) has a fresh
state and reads its tokens once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.step import SamplingSettings

if TYPE_CHECKING:
    from executor_svc.sample.logits_processors import RequestTokens


class ThinkingCount:
    """Where one request's thinking started, read up to its tokens so far."""

    def __init__(self, settings: SamplingSettings) -> None:
        self.start_id = settings.thinking_start_token_id
        self.end_id = settings.thinking_end_token_id
        self.read = 0
        # The index of the thinking's first token while it thinks, else None.
        self.since: int | None = None

    def thought(self, token_ids: Sequence[int]) -> int | None:
        """How many tokens the request has thought in its open thinking; None when it is not thinking."""
        if len(token_ids) < self.read:  # tokens taken back: read them all again
            self.read, self.since = 0, None
        start_id, end_id, since = self.start_id, self.end_id, self.since
        for i in range(self.read, len(token_ids)):
            token_id = token_ids[i]
            if token_id == start_id:
                since = i + 1
            elif token_id == end_id:
                since = None
        self.read, self.since = len(token_ids), since
        return None if since is None else len(token_ids) - since


def force_thinking_end(logits: torch.Tensor, rows: Sequence[SamplingSettings], requests: Sequence[RequestTokens],
                       index: list[int]) -> None:
    """In place: each row out of thinking budget allows only its end marker (left at 0, any finite value)."""
    forced: list[int] = []
    end_ids: list[int] = []
    for i in index:
        row = rows[i]
        if row.thinking_token_budget is None:
            continue
        request = requests[i]
        if request.matcher is not None:
            continue
        if request.thinking_count is None:
            request.thinking_count = ThinkingCount(row)
        thought = request.thinking_count.thought(request.token_ids)
        if thought is not None and thought >= row.thinking_token_budget:
            forced.append(i)
            end_ids.append(row.thinking_end_token_id)
    if forced:
        device = logits.device
        at = torch.tensor(forced, device=device)
        logits.index_fill_(0, at, float("-inf"))
        logits[at, torch.tensor(end_ids, device=device)] = 0.0
