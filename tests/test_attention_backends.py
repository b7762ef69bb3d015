"""Backend selection, and the flash-attn backend's calls into a stand-in with flash-attn's semantics."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

import executor_svc.attention as attention
from executor_svc.attention import available_backends, get_backend
from executor_svc.attention.flash_backend import FlashAttention
from executor_svc.attention.torch_backend import TorchAttention

# Imported before any test sets TRITON_INTERPRET, so the kernels stay compiled ones for this process.
from executor_svc.attention.triton_backend import TritonAttention
from executor_svc.cpu import kernels as cpu_kernels
from tests.attention_helpers import decode_meta, prefill_meta

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def no_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without a C compiler (tests/test_attention_cpu.py covers the kernel backend)."""
    monkeypatch.setattr(cpu_kernels, "kernel_library", lambda: None)


@pytest.mark.usefixtures("no_cpu_kernel")
def test_cpu_without_the_kernel_defaults_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert available_backends(CPU) == ["torch"]
    assert isinstance(get_backend(None, CPU), TorchAttention)
    assert get_backend("auto", CPU).name == "torch"


@pytest.mark.usefixtures("no_cpu_kernel")
def test_unavailable_or_unknown_name_raises_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"'triton'.*\['torch'\]"):
        get_backend("triton", CPU)
    with pytest.raises(ValueError, match=r"'sdpa'.*\['torch'\]"):
        get_backend("sdpa", CPU)


@pytest.mark.usefixtures("no_cpu_kernel")
def test_cpu_offers_triton_after_torch_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available_backends(CPU) == ["torch", "triton"]
    assert get_backend(None, CPU).name == "torch"
    assert isinstance(get_backend("triton", CPU), TritonAttention)


def test_cuda_prefers_flash_attn_then_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_importable", lambda module: True)
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    assert available_backends(CUDA) == ["flash_attn", "triton", "torch"]
    assert isinstance(get_backend(None, CUDA), FlashAttention)
    monkeypatch.setattr(attention, "_importable", lambda module: module != "flash_attn")
    assert available_backends(CUDA) == ["triton", "torch"]
    assert isinstance(get_backend(None, CUDA), TritonAttention)
    with pytest.raises(ValueError, match="flash_attn"):
        get_backend("flash_attn", CUDA)


def _context(k: torch.Tensor, block_table: torch.Tensor | None, start: int, length: int) -> torch.Tensor:
    """A request's first ``length`` keys: packed rows from ``start``, or paged rows through ``block_table``."""
    if block_table is None:
        return k[start : start + length]
    pos = torch.arange(length)
    block_size = k.shape[1]
    return k.flatten(0, 1)[block_table[pos // block_size].long() * block_size + pos % block_size]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention with queries aligned to the end of the keys (flash-attn >= 2.1), GQA by head groups."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def fake_flash_attn() -> ModuleType:
    """flash-attn's two entry points with its argument order and semantics, in plain torch."""

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale, causal, block_table=None
    ):
        assert causal and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        outs = []
        for i in range(len(cu_seqlens_q) - 1):
            q_i = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
            length = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            table = None if block_table is None else block_table[i]
            k_i = _context(k, table, int(cu_seqlens_k[i]), length)
            v_i = _context(v, table, int(cu_seqlens_k[i]), length)
            outs.append(_dense(q_i, k_i, v_i, softmax_scale))
        return torch.cat(outs)

    def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
        assert causal and q.shape[1] == 1
        outs = []
        for i in range(q.shape[0]):
            length = int(cache_seqlens[i])
            k_i, v_i = _context(k_cache, block_table[i], 0, length), _context(v_cache, block_table[i], 0, length)
            outs.append(_dense(q[i], k_i, v_i, softmax_scale))
        return torch.stack(outs)

    module = ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def paged_step(ctx_lens: list[int], q_lens: list[int], block_size: int) -> tuple[torch.Tensor, ...]:
    """bfloat16 q, k, v for this step and caches already holding every request's context."""
    gen = torch.Generator().manual_seed(5)
    tables = torch.randperm(8, generator=gen).view(len(ctx_lens), -1).to(torch.int32)
    k_cache = torch.randn(8, block_size, 2, 16, generator=gen).bfloat16()
    v_cache = torch.randn(8, block_size, 2, 16, generator=gen).bfloat16()
    q = torch.randn(sum(q_lens), 4, 16, generator=gen).bfloat16()
    rows = [_context(torch.arange(8 * block_size).view(8, block_size), tables[i], 0, n) for i, n in enumerate(ctx_lens)]
    new_rows = torch.cat([r[n - m :] for r, n, m in zip(rows, ctx_lens, q_lens, strict=True)])
    k, v = k_cache.flatten(0, 1)[new_rows], v_cache.flatten(0, 1)[new_rows]
    return q, k, v, k_cache, v_cache, tables, new_rows


def test_flash_prefill_passes_packed_or_paged_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    ctx_lens, q_lens = [300, 170], [45, 170]
    q, k, v, k_cache, v_cache, tables, slots = paged_step(ctx_lens, q_lens, 256)
    for lens in (ctx_lens, q_lens):  # paged context from the cache, then each request's own packed keys
        meta = prefill_meta(slots, tables, lens, q_lens)
        out = FlashAttention().prefill(q, k, v, k_cache, v_cache, meta, 0.25)
        expected = TorchAttention().prefill(q, k, v, k_cache, v_cache, meta, 0.25)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_flash_decode_reads_the_cache_through_block_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    ctx_lens = [400, 9]
    q, _, _, k_cache, v_cache, tables, slots = paged_step(ctx_lens, [1, 1], 256)
    meta = decode_meta(slots, tables, ctx_lens)
    out = FlashAttention().decode(q, k_cache, v_cache, meta, 0.25)
    expected = TorchAttention().decode(q, k_cache, v_cache, meta, 0.25)
    assert out.shape == q.shape
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
