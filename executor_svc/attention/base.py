"""The paged KV layout and the interface every attention backend implements.

KV cache, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size``;
``slot_mapping`` gives that slot for every token computed this step.

A step is either all prefill or all decode (the scheduler never mixes them).
Prefill tokens are packed ("varlen"): request ``i`` contributes the query
tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are the *last* tokens of
its context of ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` tokens (cached prefix
and earlier chunks come first and are read from the cache). Decode has one
query token per request whose context is ``context_lens[i]`` tokens, itself
included. Attention is causal throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # [num_tokens] int64: cache slot of each token computed this step.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] int32, padded with -1.
    block_tables: torch.Tensor
    # Prefill only: [num_seqs + 1] int32 prefix sums of query and context lengths.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # True when some prefill request reads context from the cache (a prefix hit
    # or an earlier chunk), so attention cannot use only this step's k and v.
    has_cached_context: bool = False
    # Decode only: [num_seqs] int32 context length of each request.
    context_lens: torch.Tensor | None = None


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` of shape [num_tokens, num_kv_heads, head_dim] into their slots."""
        ...

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal varlen attention: q [num_tokens, num_heads, head_dim] -> same shape.

        Called after ``store_kv``, so the cache already holds this step's keys.
        """
        ...

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """One query per request: q [num_seqs, num_heads, head_dim] -> same shape."""
        ...
