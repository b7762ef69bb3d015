"""The attention backend built on our own Triton kernels (``triton_kernels.py``)."""

from __future__ import annotations

import torch

from executor_svc.attention import triton_kernels
from executor_svc.attention.base import AttentionMetadata, SplitsMixed


class TritonAttention(SplitsMixed):
    """Paged KV store, paged decode and paged varlen prefill, each one Triton kernel launch."""

    name = "triton"

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        triton_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

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
        # Without cached context this step's k, v are the whole context: read them directly, not via the cache.
        if meta.has_cached_context:
            k, v, block_tables = k_cache, v_cache, meta.block_tables
        else:
            block_tables = None
        return triton_kernels.paged_prefill(
            q, k, v, block_tables, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, scale
        )

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return triton_kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
