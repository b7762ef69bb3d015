"""The attention backend on flash-attn 2 (CUDA only; imported lazily since it is an optional dependency)."""

from __future__ import annotations

import torch

from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.triton_backend import TritonAttention

# flash-attn 2 reads a paged cache only in pages of a multiple of 256 tokens, and only in half precision.
FLASH_PAGE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttention(TritonAttention):
    """flash-attn for attention, our Triton kernel for the KV store.

    Cases flash-attn 2 cannot take (float32, or a paged read with a block size that is not a multiple
    of 256) go to our Triton kernels, which share the layout.
    """

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

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
        paged = meta.has_cached_context
        if q.dtype not in FLASH_DTYPES or (paged and k_cache.shape[1] % FLASH_PAGE_MULTIPLE):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale)
        # Only a request with cached context needs the paged cache; otherwise this step's k, v are its context.
        keys, values, block_table = (k_cache, v_cache, meta.block_tables) if paged else (k, v, None)
        # causal with seqlen_q < seqlen_k aligns queries to the end of the context, as our layout does.
        return self._varlen(
            q,
            keys,
            values,
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=block_table,
        )

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if q.dtype not in FLASH_DTYPES or k_cache.shape[1] % FLASH_PAGE_MULTIPLE:
            return super().decode(q, k_cache, v_cache, meta, scale)
        out = self._with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
