"""The attention layer: stores this step's keys and values into the paged cache, then attends.

The cache tensors are attached by the model runner after it sized the cache;
the backend (torch, triton, flash_attn) does the work.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.attention.base import AttentionBackend, AttentionMetadata, attend


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]."""
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = attend(self.backend, q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
