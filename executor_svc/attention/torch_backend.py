"""Paged attention in plain torch: the CPU default and the reference for the other backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from executor_svc.attention.base import AttentionMetadata


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens stored in ``block_ids``: [length, num_kv_heads, head_dim]."""
    return cache.index_select(0, block_ids).flatten(0, 1)[:length]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of the context k/v [L, Hkv, D] -> [Q, H, D].

    Query i sits at position L - Q + i and sees keys up to and including itself: causal aligned to the
    lower right, which SDPA runs without a materialised mask (and skips fully masked tiles).
    """
    q_len, ctx_len = q.shape[0], k.shape[0]
    mask = None if q_len == ctx_len else causal_lower_right(q_len, ctx_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


class TorchAttention:
    """Gathers context through the block tables and runs ``scaled_dot_product_attention``."""

    name = "torch"

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))

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
        out = torch.empty_like(q)
        cu_q = meta.cu_seqlens_q.tolist()
        cu_k = meta.cu_seqlens_k.tolist()
        block_size = k_cache.shape[1]
        for i in range(len(cu_q) - 1):
            q_start, q_end = cu_q[i], cu_q[i + 1]
            q_len, ctx_len = q_end - q_start, cu_k[i + 1] - cu_k[i]
            if ctx_len == q_len:  # nothing cached for this request: its own k, v are the whole context
                ks, vs = k[q_start:q_end], v[q_start:q_end]
            else:
                block_ids = meta.block_tables[i, : -(-ctx_len // block_size)].long()
                ks = _gather_context(k_cache, block_ids, ctx_len).to(q.dtype)
                vs = _gather_context(v_cache, block_ids, ctx_len).to(q.dtype)
            out[q_start:q_end] = _causal_attention(q[q_start:q_end], ks, vs, scale)
        return out

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        context_lens = meta.context_lens.to(q.device)
        num_blocks = -(-int(context_lens.max()) // block_size)
        # Pad every request to the longest context; padding (-1 ids) reads block 0 and is masked out.
        block_ids = meta.block_tables[:, :num_blocks].long().clamp_min(0).flatten()
        padded_len = num_blocks * block_size
        ks = k_cache.index_select(0, block_ids).view(num_seqs, padded_len, num_kv_heads, head_dim)
        vs = v_cache.index_select(0, block_ids).view(num_seqs, padded_len, num_kv_heads, head_dim)
        ks, vs = ks.transpose(1, 2).to(q.dtype), vs.transpose(1, 2).to(q.dtype)
        mask = torch.arange(padded_len, device=q.device)[None, :] < context_lens[:, None]
        # Query heads sharing a KV head become that head's query rows, so K/V are not repeated for GQA.
        qg = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)
