"""Paged attention in plain torch: the CPU default and the reference for the other backends."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from executor_svc.attention.base import AttentionMetadata, SplitsMixed


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
    # A batch of one: on the CPU, SDPA runs its fused (flash) kernel only for 4-D inputs; 3-D ones took its
    # slower unfused math path.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# Decode requests are attended in groups of similar context length. A group pays a few extra ops per layer,
# worth about this many padded tokens; and its gathered K and V (at most this many bytes) stay in the CPU's
# cache for SDPA to read right after the gather, which measured faster than one large batch.
GROUP_OVERHEAD_TOKENS = 256
GROUP_MAX_BYTES = 6 << 20


@dataclass
class DecodeGroup:
    """Decode requests of similar context length, attended together, padded to the longest of them."""

    rows: torch.Tensor  # [n] int64: the requests' rows in the batch
    index: torch.Tensor  # [n * num_kv_heads * length] int64: cache rows (token, KV head) of their contexts
    mask: torch.Tensor | None  # [n, 1, 1, length] bool, True for keys in the context; None: no padding
    length: int


def split_by_length(lengths: list[int], overhead: int, max_tokens: int) -> list[int]:
    """Cut ascending ``lengths`` into runs; returns where each run ends.

    A run is padded to its longest length and holds at most ``max_tokens`` padded tokens (or one request);
    the cut minimises padded tokens plus ``overhead`` per run (dynamic programming over the run ends).
    """
    best, cut = [0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        longest = lengths[end - 1]
        first = max(0, end - max(1, max_tokens // longest))
        best[end], cut[end] = min(
            (best[start] + (end - start) * longest + overhead, start) for start in range(first, end)
        )
    ends = [len(lengths)]
    while cut[ends[-1]] > 0:
        ends.append(cut[ends[-1]])
    return ends[::-1]


def decode_groups(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int, max_tokens: int
) -> list[DecodeGroup]:
    """The decode batch sorted by context length and split so that padding to a group's longest wastes little."""
    device, tables, lengths = block_tables.device, block_tables.cpu(), context_lens.cpu()
    order = torch.argsort(lengths, stable=True)
    sorted_lens = lengths[order].tolist()
    groups, start = [], 0
    for end in split_by_length(sorted_lens, GROUP_OVERHEAD_TOKENS, max_tokens):
        rows, length = order[start:end], sorted_lens[end - 1]
        pos = torch.arange(length)
        in_context = pos[None, :] < lengths[rows][:, None]
        # Padding reads slot 0 (any valid slot will do) and is masked out.
        blocks = tables[rows][:, pos // block_size].long().clamp_min(0)
        slots = (blocks * block_size + pos % block_size).masked_fill(~in_context, 0)
        index = slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads)[None, :, None]
        mask = None if sorted_lens[start] == length else in_context[:, None, None, :].to(device)
        groups.append(DecodeGroup(rows.to(device), index.flatten().to(device), mask, length))
        start = end
    return groups


class TorchAttention(SplitsMixed):
    """Gathers context through the block tables and runs ``scaled_dot_product_attention``.

    Decode sorts the batch by context length and attends group by group (``decode_groups``), each group's
    K/V gathered contiguous; prefill attends request by request.
    """

    name = "torch"

    def __init__(self) -> None:
        # The last step's metadata, cache layout and decode groups: every layer of that step shares them.
        self._groups: tuple[AttentionMetadata | None, tuple[int, int, int], list[DecodeGroup]] = (None, (0, 0, 0), [])

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
        self.prefill_requests(q, k, v, k_cache, v_cache, meta, scale, range(len(meta.cu_seqlens_q) - 1), out)
        return out

    def prefill_requests(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, requests: Iterable[int], out: torch.Tensor,
    ) -> None:
        """Attends the step's prefill ``requests`` (their indices in ``meta``) one by one into their rows of ``out``."""
        cu_q = meta.cu_seqlens_q.tolist()
        cu_k = meta.cu_seqlens_k.tolist()
        block_size = k_cache.shape[1]
        for i in requests:
            q_start, q_end = cu_q[i], cu_q[i + 1]
            q_len, ctx_len = q_end - q_start, cu_k[i + 1] - cu_k[i]
            if ctx_len == q_len:  # nothing cached for this request: its own k, v are the whole context
                ks, vs = k[q_start:q_end], v[q_start:q_end]
            else:
                block_ids = meta.block_tables[i, : -(-ctx_len // block_size)].long()
                ks = _gather_context(k_cache, block_ids, ctx_len).to(q.dtype)
                vs = _gather_context(v_cache, block_ids, ctx_len).to(q.dtype)
            out[q_start:q_end] = _causal_attention(q[q_start:q_end], ks, vs, scale)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        keys, values = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
        out = q.new_empty(q.shape)
        max_tokens = GROUP_MAX_BYTES // (2 * num_kv_heads * head_dim * q.dtype.itemsize)
        for group in self._decode_groups(meta, k_cache.shape[1], num_kv_heads, max_tokens):
            n, length = group.rows.shape[0], group.length
            # One row per (token, KV head) lands straight in [n, kv_heads, length, head_dim]: SDPA is several
            # times faster on contiguous K/V than on the strided view a gather of whole blocks gives.
            ks = keys.index_select(0, group.index).view(n, num_kv_heads, length, head_dim).to(q.dtype)
            vs = values.index_select(0, group.index).view(n, num_kv_heads, length, head_dim).to(q.dtype)
            # Query heads sharing a KV head become that head's query rows, so K/V are not repeated for GQA.
            qg = q.index_select(0, group.rows).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=group.mask, scale=scale)
            out.index_copy_(0, group.rows, o.reshape(n, num_heads, head_dim))
        return out

    def _decode_groups(
        self, meta: AttentionMetadata, block_size: int, num_kv_heads: int, max_tokens: int
    ) -> list[DecodeGroup]:
        """Built once per step: every layer of a step gets the same metadata object."""
        layout = (block_size, num_kv_heads, max_tokens)
        if meta is not self._groups[0] or layout != self._groups[1]:
            self._groups = (meta, layout, decode_groups(meta.block_tables, meta.context_lens, *layout))
        return self._groups[2]
