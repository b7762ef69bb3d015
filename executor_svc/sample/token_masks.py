"""The token masks of vLLM's ``allowed_token_ids`` and ``bad_words``: logits set to -inf before any other processor.

Both run here, where every token a request has is known when its row is sampled: the tokens of a multi-step plan's
earlier passes and of the step before (overlap) are recorded by then, and a verification appends the proposals
before each position it samples, so a banned proposal is never the token sampled there and is never accepted. A
request that comes back (preemption, an executor restart) brings its settings and its completion again.

A request's masks are made once, at its first sample (``TokenMasks`` on its state): the allowed ids as a tensor,
and the bad words indexed by the ids before their last, so that a step matches each request with one dictionary
lookup per distinct prefix length, whatever the number of words. A batch's masks are then one gather, fill and
scatter for the allowed ids and one scatter of -inf for the banned ones; rows without them are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.step import SamplingSettings

if TYPE_CHECKING:
    from executor_svc.sample.logits_processors import RequestTokens


class TokenMasks:
    """One request's allowed ids and bad words, ready for every step."""

    def __init__(self, settings: SamplingSettings) -> None:
        allowed = settings.allowed_token_ids
        self._allowed = {torch.device("cpu"): torch.tensor(allowed, dtype=torch.int64)} if allowed else {}
        # One-token words are banned at every position.
        self.always: list[int] = []
        # Prefix length -> {the ids before the last: the last ids they ban}, shortest first.
        by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in settings.bad_words_token_ids:
            if len(word) == 1:
                self.always.append(word[0])
            else:
                by_length.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
        self.by_length = sorted(by_length.items())

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The allowed ids on ``device`` (copied there once)."""
        ids = self._allowed.get(device)
        if ids is None:
            ids = self._allowed[device] = self._allowed[torch.device("cpu")].to(device)
        return ids

    def banned(self, token_ids: Sequence[int], num_prompt_tokens: int) -> list[int]:
        """The ids the bad words ban after ``token_ids``: as vLLM, only the completion can hold a word's prefix."""
        out = list(self.always)
        room = len(token_ids) - num_prompt_tokens
        for length, last_ids in self.by_length:
            if length > room:
                break
            out += last_ids.get(tuple(token_ids[-length:]), ())
        return out


def masks_of(request: RequestTokens, settings: SamplingSettings) -> TokenMasks:
    masks = request.token_masks
    if masks is None:
        masks = request.token_masks = TokenMasks(settings)
    return masks


def mask_allowed(logits: torch.Tensor, rows: Sequence[SamplingSettings], requests: Sequence[RequestTokens],
                 index: list[int]) -> None:
    """-inf, in place, everywhere but at each restricted row's allowed ids."""
    restricted = [i for i in index if rows[i].allowed_token_ids]
    if not restricted:
        return
    device, vocab = logits.device, logits.shape[1]
    # Flat positions in the (contiguous) logits: a 1-D index_select and index_copy_ beat 2-D advanced indexing.
    flat_index = torch.cat([masks_of(requests[i], rows[i]).allowed(device) + i * vocab for i in restricted])
    flat = logits.view(-1)
    kept = flat.index_select(0, flat_index)
    logits.index_fill_(0, torch.tensor(restricted, device=device), float("-inf"))
    flat.index_copy_(0, flat_index, kept)


def ban_bad_words(logits: torch.Tensor, rows: Sequence[SamplingSettings], requests: Sequence[RequestTokens],
                  index: list[int]) -> None:
    """-inf, in place, at each row's ids that would complete one of its bad words."""
    at_rows: list[int] = []
    at_ids: list[int] = []
    for i in index:
        if rows[i].bad_words_token_ids:
            request = requests[i]
            banned = masks_of(request, rows[i]).banned(request.token_ids, request.num_prompt_tokens)
            at_rows += [i] * len(banned)
            at_ids += banned
    if at_ids:
        device = logits.device
        logits.index_put_((torch.tensor(at_rows, device=device), torch.tensor(at_ids, device=device)),
                          torch.tensor(float("-inf"), device=device))
