"""Attention metadata for test batches, shared by the torch-backend tests and the Triton kernel cases; the CPU kernel
builds the kernel tests run on."""

from __future__ import annotations

import torch

from executor_svc.attention.base import AttentionMetadata


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


def cpu_kernel_builds() -> list[object]:
    """pytest params of the CPU kernel builds to test: this machine's own and, on an AVX-512 machine, the AVX2
    variant of the same sources, so that both instruction sets' kernels are tested wherever the suite runs."""
    import pytest

    from executor_svc.cpu import kernels as cpu_kernels

    native = cpu_kernels.kernel_library()
    builds = [pytest.param(native, id="native")]
    flags = cpu_kernels.cpuinfo("flags").split()
    if native is not None and {"avx512f", "avx2", "fma"} <= set(flags):
        builds.append(pytest.param(cpu_kernels.kernel_library(("-mno-avx512f",)), id="avx2"))
    return builds
