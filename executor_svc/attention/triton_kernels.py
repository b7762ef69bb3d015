"""Triton kernels over the paged KV layout: KV store, paged decode and paged (varlen, causal) prefill.

Keys and values are read token by token through the block table (``block_id * block_size + offset``)
in tiles of ``BLOCK_N`` tokens, so any block size works and block ids need not be contiguous.
The attention kernels keep a running max and sum (online softmax) and accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # a padding token: nothing to write
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    row_offsets,
    key_mask,
    score_mask,
    dims,
    dim_mask,
    m_i,
    l_i,
    acc,
    scale,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of ``q`` against the tile of keys and values whose rows start at ``row_offsets``."""
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_ptr + row_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + row_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale
    scores = tl.where(score_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # Rows with no visible key yet keep m = -inf; shift by 0 there so exp() yields 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    group,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (request, KV head): the query heads sharing that KV head form the rows of one tile."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < group
    dim_mask = dims < head_dim
    heads = kv_head * group + rows
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_mask = key_pos < context_len
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + key_pos // block_size, mask=key_mask, other=0)
        block_ids = block_ids.to(tl.int64)
        row_offsets = block_ids * stride_cb + (key_pos % block_size) * stride_cs + kv_head * stride_ch
        m_i, l_i, acc = _attend_tile(
            q,
            k_cache_ptr,
            v_cache_ptr,
            row_offsets,
            key_mask,
            key_mask[None, :],
            dims,
            dim_mask,
            m_i,
            l_i,
            acc,
            scale,
            DOT_PRECISION,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    block_size,
    group,
    head_dim,
    PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (query tile, request, query head).

    With ``PAGED`` the context is read from the cache through the block table (cached prefix, earlier
    chunks and this chunk alike); without it, k/v are this step's packed tensors and ``stride_kb`` is unused.
    """
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(cu_seqlens_k_ptr + seq + 1) - tl.load(cu_seqlens_k_ptr + seq)
    if tile * BLOCK_M >= q_len:
        return
    kv_head = head // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    # Query row r sits at position context_len - q_len + r and sees keys up to and including itself.
    q_pos = context_len - q_len + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
    for start in range(0, key_end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_mask = key_pos < context_len
        if PAGED:
            block_ids = tl.load(block_tables_ptr + seq * stride_bt + key_pos // block_size, mask=key_mask, other=0)
            block_ids = block_ids.to(tl.int64)
            row_offsets = block_ids * stride_kb + (key_pos % block_size) * stride_ks + kv_head * stride_kh
        else:
            row_offsets = (q_start + key_pos) * stride_ks + kv_head * stride_kh
        score_mask = key_mask[None, :] & (key_pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_tile(
            q,
            k_ptr,
            v_ptr,
            row_offsets,
            key_mask,
            score_mask,
            dims,
            dim_mask,
            m_i,
            l_i,
            acc,
            scale,
            DOT_PRECISION,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _dot_precision(dtype: torch.dtype) -> str | None:
    """Exact ("ieee") float32 dots, since TF32 would break float32 parity; the platform default otherwise."""
    return "ieee" if dtype == torch.float32 else None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _same_layout(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels address k and v with one set of strides."""
    if k.stride() == v.stride() and k.stride(-1) == 1:
        return k, v
    return k.contiguous(), v.contiguous()


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their cache slots, skipping slot -1."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int = 32,
) -> torch.Tensor:
    """One query token per request, q [num_seqs, num_heads, head_dim], over its paged context."""
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _same_layout(k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
        group,
        head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_tables: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    block_m: int = 32,
    block_n: int = 32,
) -> torch.Tensor:
    """Causal varlen attention, q [num_tokens, num_heads, head_dim].

    With ``block_tables``, k/v are the paged caches and each request's context (cached prefix plus this
    chunk) is read through its block table; without, k/v are this step's [num_tokens, num_kv_heads,
    head_dim] tensors and each request attends only to its own tokens.
    """
    q = _last_dim_contiguous(q)
    k, v = _same_layout(k, v)
    num_heads, head_dim = q.shape[1], q.shape[2]
    paged = block_tables is not None
    num_kv_heads = k.shape[2] if paged else k.shape[1]
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if paged:
        stride_kb, stride_ks, stride_kh, block_size = k.stride(0), k.stride(1), k.stride(2), k.shape[1]
        stride_bt = block_tables.stride(0)
    else:
        # An unpaged k is one "block" of tokens: position p is row q_start + p.
        stride_kb, stride_ks, stride_kh, block_size, stride_bt = 0, k.stride(0), k.stride(1), 1, 0
    _paged_prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)](
        q,
        k,
        v,
        out,
        block_tables if paged else cu_seqlens_q,
        cu_seqlens_q,
        cu_seqlens_k,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        stride_kb,
        stride_ks,
        stride_kh,
        stride_bt,
        block_size,
        num_heads // num_kv_heads,
        head_dim,
        PAGED=paged,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out
