"""Attention metadata for test batches, shared by the torch-backend tests and the Triton kernel cases; mixed steps
packed as the executor packs them, with their per-request reference; the CPU kernel builds the kernel tests run on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.step import SamplingSettings
from executor_svc.attention.base import AttentionBackend, AttentionMetadata, attend
from executor_svc.core.request_table import RequestState, ScheduledChunk
from executor_svc.runtime.model_input import ModelInput, prepare_input


def prefill_meta(
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, ctx_lens: list[int], q_lens: list[int]
) -> AttentionMetadata:
    """Each request's ``q_lens[i]`` query tokens are the last of its ``ctx_lens[i]`` context tokens."""
    return AttentionMetadata(
        is_prefill=True,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        cu_seqlens_k=torch.tensor([0, *ctx_lens]).cumsum(0).to(torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ctx_lens),
        has_cached_context=ctx_lens != q_lens,
    )


def decode_meta(slot_mapping: torch.Tensor, block_tables: torch.Tensor, ctx_lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
    )


def cpu_kernel_builds(without_amx: bool = False) -> list[object]:
    """pytest params of the CPU kernel builds to test: this machine's own and, on an AVX-512 machine, the AVX2
    variant of the same sources, so that both instruction sets' kernels are tested wherever the suite runs.
    ``without_amx``: on a machine with AMX, also the build without it (only the linear kernel has an AMX path)."""
    import pytest

    from executor_svc.cpu import kernels as cpu_kernels
    from executor_svc.cpu.cpuinfo import cpu_flags

    native = cpu_kernels.kernel_library()
    builds = [pytest.param(native, id="native")]
    flags = cpu_flags()
    if native is not None and {"avx512f", "avx2", "fma"} <= flags:
        builds.append(pytest.param(cpu_kernels.kernel_library(("-mno-avx512f",)), id="avx2"))
    if without_amx and native is not None and native.linear_amx_ready():
        builds.append(pytest.param(cpu_kernels.kernel_library(("-mno-amx-tile",)), id="avx512"))
    return builds


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request in float32 SDPA: q [n, heads, head_dim] are the last n positions of its context k/v [L, kv_heads,
    head_dim], each seeing the keys up to its own."""
    n, length, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    k, v = (x.float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


class MixedStep:
    """Requests of ``(context length, query tokens)`` in the plan's order, packed by ``prepare_input`` into one step
    over a paged cache (shuffled block ids) that holds each context's tokens before its queries. A request of one
    query token is a decode row, the rest prefill chunks (with a cached prefix where the context is longer)."""

    def __init__(self, requests: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests, self.dtype = requests, dtype
        per_request = [-(-length // block_size) for length, _ in requests]
        ids = torch.randperm(sum(per_request) + 2, generator=gen).tolist()
        chunks = []
        for i, ((length, n), blocks) in enumerate(zip(requests, per_request, strict=True)):
            state = RequestState(i, [0] * length, [ids.pop() for _ in range(blocks)], length - n, SamplingSettings(),
                                 length)
            chunks.append(ScheduledChunk(state, length - n, n))
        self.input: ModelInput = prepare_input(chunks, block_size)
        self.k = [torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype) for length, _ in requests]
        self.v = [torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype) for length, _ in requests]
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for _, n in requests]
        # Each request's packed rows: every chunk samples, so ``logits_indices`` holds its last row.
        self.rows = [torch.arange(int(last) - n + 1, int(last) + 1)
                     for last, (_, n) in zip(self.input.logits_indices, requests, strict=True)]
        shape = (len(ids) + sum(per_request), block_size, num_kv_heads, head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        flat_k, flat_v = self.k_cache.view(-1, num_kv_heads, head_dim), self.v_cache.view(-1, num_kv_heads, head_dim)
        for (length, n), chunk, k, v in zip(requests, chunks, self.k, self.v, strict=True):
            pos = torch.arange(length - n)
            slots = torch.tensor(chunk.state.block_table)[pos // block_size] * block_size + pos % block_size
            flat_k[slots], flat_v[slots] = k[: length - n], v[: length - n]

    def packed(self, per_request: list[torch.Tensor]) -> torch.Tensor:
        """This step's rows of ``per_request`` (queries, or keys or values over the whole context): the last ones."""
        out = torch.empty(int(self.input.positions.shape[0]), *per_request[0].shape[1:], dtype=self.dtype)
        for rows, x in zip(self.rows, per_request, strict=True):
            out[rows] = x[-len(rows):]
        return out

    def run(self, backend: AttentionBackend, scale: float, store: AttentionBackend | None = None) -> list[torch.Tensor]:
        """The backend's store (or ``store``'s) and attention, as the attention layer calls them; each request's rows
        in the plan's order."""
        q, k, v = self.packed(self.q), self.packed(self.k), self.packed(self.v)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        meta = self.input.meta
        (store or backend).store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attend(backend, q, k, v, k_cache, v_cache, meta, scale)
        return [out[rows] for rows in self.rows]

    def expected(self, scale: float) -> list[torch.Tensor]:
        return [sdpa_reference(q, k, v, scale) for q, k, v in zip(self.q, self.k, self.v, strict=True)]
