"""Kernel-by-kernel checks of our Triton kernels against the torch backend, under ``TRITON_INTERPRET=1``.

Whether triton interprets is fixed process-wide when it is first imported, so these cases live outside
the suite's collection and ``tests/test_attention_triton.py`` runs them in a child process with the
variable set. Run them directly with ``TRITON_INTERPRET=1 pytest tests/triton_kernel_cases.py``.
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from executor_svc.attention import triton_kernels as kernels
from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.flash_backend import FlashAttention
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.attention.triton_backend import TritonAttention
from tests.attention_helpers import MixedStep, decode_meta, prefill_meta

if not isinstance(tl.sum, InterpretedFunction):
    raise RuntimeError("these cases need the triton interpreter: run them with TRITON_INTERPRET=1")

HEAD_DIM = 16
SCALE = 0.25
HEADS = [(4, 4), (6, 2), (4, 1)]
BLOCK_SIZES = [1, 3, 16]


class Batch:
    """Requests with given context and query lengths over a random paged cache with shuffled block ids."""

    def __init__(
        self, ctx_lens: list[int], q_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, seed: int = 0
    ):
        gen = torch.Generator().manual_seed(seed)
        self.ctx_lens, self.q_lens, self.block_size = ctx_lens, q_lens, block_size
        blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(blocks_per_seq) + 2
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[ids.pop() for _ in range(n)] for n in blocks_per_seq]
        width = max(blocks_per_seq) + 2
        self.block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.k_cache, self.v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        num_tokens = sum(q_lens)
        self.q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
        self.k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
        self.v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)

    def slot_mapping(self) -> torch.Tensor:
        slots = []
        for table, n, m in zip(self.tables, self.ctx_lens, self.q_lens, strict=True):
            pos = torch.arange(n - m, n)
            slots.append(torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size)
        return torch.cat(slots)

    def prefill_meta(self) -> AttentionMetadata:
        return prefill_meta(self.slot_mapping(), self.block_tables, self.ctx_lens, self.q_lens)

    def decode_meta(self) -> AttentionMetadata:
        return decode_meta(self.slot_mapping(), self.block_tables, self.ctx_lens)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's k, v stored into a copy of the caches by the reference backend."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        TorchAttention().store_kv(self.k, self.v, k_cache, v_cache, self.slot_mapping())
        return k_cache, v_cache


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv_matches_torch_and_skips_padding(block_size: int) -> None:
    batch = Batch([5, 2 * block_size + 1], [5, block_size + 1], block_size, 4, 2)
    slots = batch.slot_mapping()
    slots[1] = -1
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    TorchAttention().store_kv(batch.k, batch.v, expected_k, expected_v, slots)
    # k and v arrive as strided views of a packed tensor, as when split from a fused qkv projection.
    packed = torch.cat([batch.k, batch.v], dim=1)
    kernels.store_kv(packed[:, :2], packed[:, 2:], batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)


def test_store_kv_casts_to_cache_dtype() -> None:
    batch = Batch([7], [7], 4, 2, 2)
    k_cache, v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    kernels.store_kv(batch.k, batch.v, k_cache, v_cache, batch.slot_mapping())
    flat = k_cache.view(-1, 2, HEAD_DIM)[batch.slot_mapping()]
    # bfloat16 tolerance: the interpreter truncates where the GPU rounds to nearest.
    torch.testing.assert_close(flat, batch.k.bfloat16())


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_without_cached_context(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    lens = [9, 1, 40]
    batch = Batch(lens, lens, block_size, num_heads, num_kv_heads)
    meta = batch.prefill_meta()
    k_cache, v_cache = batch.caches()
    expected = TorchAttention().prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE)
    out = kernels.paged_prefill(
        batch.q, batch.k, batch.v, None, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, SCALE
    )
    assert_close(out, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_through_block_table_with_prefix_hits_and_chunks(
    num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    # Prefix hit of whole blocks, a chunk starting mid-block, no cache at all, one query token after a long context.
    ctx_lens = [2 * block_size + 7, 45, 11, 38]
    q_lens = [7, 20, 11, 1]
    batch = Batch(ctx_lens, q_lens, block_size, num_heads, num_kv_heads, seed=block_size)
    meta = batch.prefill_meta()
    k_cache, v_cache = batch.caches()
    expected = TorchAttention().prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE)
    out = kernels.paged_prefill(
        batch.q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, SCALE
    )
    assert_close(out, expected)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 64)])
def test_prefill_tile_sizes_agree(block_m: int, block_n: int) -> None:
    """Query tiles that end mid-request and key tiles that straddle the causal edge."""
    batch = Batch([70, 33], [37, 33], 8, 4, 2, seed=3)
    meta = batch.prefill_meta()
    k_cache, v_cache = batch.caches()
    expected = TorchAttention().prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE)
    out = kernels.paged_prefill(
        batch.q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.cu_seqlens_k,
        meta.max_seqlen_q,
        SCALE,
        block_m=block_m,
        block_n=block_n,
    )
    assert_close(out, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    ctx_lens = [1, 37, block_size, 70, 4]
    batch = Batch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads, seed=7)
    meta = batch.decode_meta()
    k_cache, v_cache = batch.caches()
    expected = TorchAttention().decode(batch.q, k_cache, v_cache, meta, SCALE)
    out = kernels.paged_decode(batch.q, k_cache, v_cache, meta.block_tables, meta.context_lens, SCALE)
    assert_close(out, expected)


def test_backend_chunked_prefill_then_decode() -> None:
    """The backend class end to end: a 29-token prompt in chunks of 12, 12, 5 on two requests, then 2 decode steps."""
    triton_attention, reference = TritonAttention(), TorchAttention()
    num_heads, num_kv_heads, block_size, total = 6, 2, 4, 31
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, total, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(2, total, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(2, total, num_kv_heads, HEAD_DIM, generator=gen)
    tables = torch.randperm(20, generator=gen)[:16].view(2, 8).to(torch.int32)
    caches = {name: torch.zeros(20, block_size, num_kv_heads, HEAD_DIM) for name in ("k", "v", "k_ref", "v_ref")}
    for start, end in [(0, 12), (12, 24), (24, 29), (29, 30), (30, 31)]:
        pos = torch.arange(start, end)
        slots = torch.cat([tables[i].long()[pos // block_size] * block_size + pos % block_size for i in range(2)])
        qs, ks, vs = (x[:, start:end].flatten(0, 1) for x in (q, k, v))
        for backend, kc, vc in [(triton_attention, "k", "v"), (reference, "k_ref", "v_ref")]:
            backend.store_kv(ks, vs, caches[kc], caches[vc], slots)
        if end <= 29:
            n = end - start
            meta = AttentionMetadata(
                is_prefill=True,
                slot_mapping=slots,
                block_tables=tables,
                cu_seqlens_q=torch.tensor([0, n, 2 * n], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, end, 2 * end], dtype=torch.int32),
                max_seqlen_q=n,
                max_seqlen_k=end,
                has_cached_context=start > 0,
            )
            out = triton_attention.prefill(qs, ks, vs, caches["k"], caches["v"], meta, SCALE)
            expected = reference.prefill(qs, ks, vs, caches["k_ref"], caches["v_ref"], meta, SCALE)
        else:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=slots,
                block_tables=tables,
                context_lens=torch.tensor([end, end], dtype=torch.int32),
            )
            out = triton_attention.decode(qs, caches["k"], caches["v"], meta, SCALE)
            expected = reference.decode(qs, caches["k_ref"], caches["v_ref"], meta, SCALE)
        assert torch.equal(caches["k"], caches["k_ref"]) and torch.equal(caches["v"], caches["v_ref"])
        assert_close(out, expected)


def _refuse(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("flash-attn 2 was called for a case it does not support")


def test_flash_backend_falls_back_to_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 with 16-token pages is out of flash-attn 2's reach: store, prefill and decode use our kernels."""
    flash_attn = ModuleType("flash_attn")
    flash_attn.flash_attn_varlen_func = flash_attn.flash_attn_with_kvcache = _refuse
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    backend, reference = FlashAttention(), TorchAttention()
    for batch in (Batch([13, 6], [5, 6], 16, 4, 2), Batch([6, 6], [6, 6], 16, 4, 2)):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        backend.store_kv(batch.k, batch.v, k_cache, v_cache, batch.slot_mapping())
        expected_k, expected_v = batch.caches()
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
        meta = batch.prefill_meta()
        out = backend.prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE)
        assert_close(out, reference.prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE))
    decode = Batch([21, 2], [1, 1], 16, 4, 2)
    k_cache, v_cache = decode.caches()
    meta = decode.decode_meta()
    out = backend.decode(decode.q, k_cache, v_cache, meta, SCALE)
    assert_close(out, reference.decode(decode.q, k_cache, v_cache, meta, SCALE))


def test_half_precision_prefill_and_decode() -> None:
    """float16 q and caches (the interpreter cannot do bfloat16 dots), against float32 attention on the same values."""
    batch = Batch([21, 9], [6, 9], 4, 6, 2, seed=9)
    k_cache, v_cache = (cache.half() for cache in batch.caches())
    q = batch.q.half()
    meta = batch.prefill_meta()
    out = kernels.paged_prefill(
        q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, SCALE
    )
    expected = TorchAttention().prefill(q.float(), batch.k, batch.v, k_cache.float(), v_cache.float(), meta, SCALE)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    decode_meta = batch.decode_meta()  # one more query token per request over the same contexts
    out = kernels.paged_decode(q[:2], k_cache, v_cache, decode_meta.block_tables, decode_meta.context_lens, SCALE)
    expected = TorchAttention().decode(q[:2].float(), k_cache.float(), v_cache.float(), decode_meta, SCALE)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_a_mixed_step_gives_decode_rows_their_decode(block_size: int) -> None:
    """A step of the mixed policy: decode rows (one query token after their context) packed with prefill chunks go
    through the prefill kernel, and each decode row gets what the decode kernel gives it alone."""
    ctx_lens, q_lens = [37, 12, block_size + 3, 70, 5], [1, 12, 1, 9, 1]
    batch = Batch(ctx_lens, q_lens, block_size, 6, 2, seed=5)
    meta = batch.prefill_meta()
    k_cache, v_cache = batch.caches()
    mixed = kernels.paged_prefill(
        batch.q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, SCALE
    )
    assert_close(mixed, TorchAttention().prefill(batch.q, batch.k, batch.v, k_cache, v_cache, meta, SCALE))
    rows = [i for i, n in enumerate(q_lens) if n == 1]
    last = (meta.cu_seqlens_q[1:] - 1).long()[rows]
    decode = kernels.paged_decode(batch.q[last], k_cache, v_cache, meta.block_tables[rows],
                                  torch.tensor([ctx_lens[i] for i in rows], dtype=torch.int32), SCALE)
    assert_close(mixed[last], decode)


@pytest.mark.parametrize("block_size", [3, 16])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
def test_a_mixed_step_through_decode_and_prefill_kernels(block_size: int, dtype: torch.dtype, tolerance: float) -> None:
    """A mixed step as the executor packs it (a new prompt ahead of decode rows, a chunk after a cached prefix): the
    decode kernel takes the decode rows, the prefill kernel the chunks, and each request's rows equal SDPA's."""
    step = MixedStep([(40, 40), (37, 1), (block_size + 3, 1), (70, 9), (1, 1), (5, 1)], block_size, 6, 2, HEAD_DIM,
                     dtype, seed=3)
    assert step.input.meta.mixed is not None and step.input.meta.mixed.num_decodes == 4
    for out, expected in zip(step.run(TritonAttention(), SCALE), step.expected(SCALE), strict=True):
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
