"""The torch attention backend against dense per-request attention over unpaged K/V."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.attention import torch_backend
from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.torch_backend import TorchAttention, decode_groups, split_by_length
from tests.attention_helpers import decode_meta, prefill_meta

HEAD_DIM = 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of a context k/v [L, Hkv, D], in float64."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    scores = scores.masked_fill(torch.arange(ctx_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


class PagedBatch:
    """Random requests laid out in a paged cache with shuffled (non-contiguous) block ids."""

    def __init__(
        self, ctx_lens: list[int], q_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
        head_dim: int = HEAD_DIM,
    ):
        gen = torch.Generator().manual_seed(sum(ctx_lens) * 31 + block_size)
        self.block_size, self.ctx_lens, self.q_lens = block_size, ctx_lens, q_lens
        blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(blocks_per_seq) + 3
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[ids.pop() for _ in range(n)] for n in blocks_per_seq]
        width = max(blocks_per_seq) + 1
        self.block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache, self.v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in ctx_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in ctx_lens]
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen) for n in q_lens]
        for i, (n, m) in enumerate(zip(ctx_lens, q_lens, strict=True)):
            cached = self.slots(i, 0, n - m)
            self.k_cache.view(-1, num_kv_heads, head_dim)[cached] = self.k[i][: n - m]
            self.v_cache.view(-1, num_kv_heads, head_dim)[cached] = self.v[i][: n - m]

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(self.tables[seq], dtype=torch.int64)[pos // self.block_size] * self.block_size + (
            pos % self.block_size
        )

    def new_k(self) -> torch.Tensor:
        return torch.cat([k[n - m :] for k, n, m in zip(self.k, self.ctx_lens, self.q_lens, strict=True)])

    def new_v(self) -> torch.Tensor:
        return torch.cat([v[n - m :] for v, n, m in zip(self.v, self.ctx_lens, self.q_lens, strict=True)])

    def slot_mapping(self) -> torch.Tensor:
        pairs = enumerate(zip(self.ctx_lens, self.q_lens, strict=True))
        return torch.cat([self.slots(i, n - m, n) for i, (n, m) in pairs])

    def prefill_meta(self) -> AttentionMetadata:
        return prefill_meta(self.slot_mapping(), self.block_tables, self.ctx_lens, self.q_lens)

    def decode_meta(self) -> AttentionMetadata:
        return decode_meta(self.slot_mapping(), self.block_tables, self.ctx_lens)

    def expected(self, scale: float) -> torch.Tensor:
        return torch.cat([dense_attention(q, k, v, scale) for q, k, v in zip(self.q, self.k, self.v, strict=True)])


HEADS = [(4, 4), (8, 2), (6, 1)]
BLOCK_SIZES = [1, 4, 16]


def run_prefill(batch: PagedBatch) -> torch.Tensor:
    backend = TorchAttention()
    k, v = batch.new_k(), batch.new_v()
    backend.store_kv(k, v, batch.k_cache, batch.v_cache, batch.slot_mapping())
    scale = 1 / math.sqrt(HEAD_DIM)
    return backend.prefill(torch.cat(batch.q), k, v, batch.k_cache, batch.v_cache, batch.prefill_meta(), scale)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_without_cached_context(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    lens = [7, 1, 19, 16]
    batch = PagedBatch(lens, lens, block_size, num_heads, num_kv_heads)
    out = run_prefill(batch)
    torch.testing.assert_close(out, batch.expected(1 / math.sqrt(HEAD_DIM)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_with_prefix_hits_and_chunks(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # A prefix hit of whole blocks, a later chunk starting mid-block, a request with no cache, a 1-token query.
    ctx_lens = [2 * block_size + 5, 23, 9, 12]
    q_lens = [5, 10, 9, 1]
    batch = PagedBatch(ctx_lens, q_lens, block_size, num_heads, num_kv_heads)
    out = run_prefill(batch)
    torch.testing.assert_close(out, batch.expected(1 / math.sqrt(HEAD_DIM)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_mixed_context_lengths(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    ctx_lens = [1, 17, 40, block_size, 3]
    batch = PagedBatch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads)
    backend = TorchAttention()
    backend.store_kv(batch.new_k(), batch.new_v(), batch.k_cache, batch.v_cache, batch.slot_mapping())
    scale = 0.3
    out = backend.decode(torch.cat(batch.q), batch.k_cache, batch.v_cache, batch.decode_meta(), scale)
    torch.testing.assert_close(out, batch.expected(scale), atol=1e-5, rtol=1e-5)


def run_decode(batch: PagedBatch, scale: float, backend: TorchAttention | None = None) -> torch.Tensor:
    backend = backend or TorchAttention()
    backend.store_kv(batch.new_k(), batch.new_v(), batch.k_cache, batch.v_cache, batch.slot_mapping())
    return backend.decode(torch.cat(batch.q), batch.k_cache, batch.v_cache, batch.decode_meta(), scale)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("max_tokens", [0, 40, 10**6])
def test_decode_groups_of_similar_length(
    num_heads: int, num_kv_heads: int, block_size: int, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unsorted odd lengths, ties and a long outlier; groups of one request each, of a few, or one for all."""
    monkeypatch.setattr(torch_backend, "GROUP_MAX_BYTES", max_tokens * 2 * num_kv_heads * HEAD_DIM * 4)
    ctx_lens = [33, 1, 17, 64, 17, 2, 31, 300, 16, 5, 33]
    batch = PagedBatch(ctx_lens, [1] * len(ctx_lens), block_size, num_heads, num_kv_heads)
    torch.testing.assert_close(run_decode(batch, 0.3), batch.expected(0.3), atol=1e-5, rtol=1e-5)


def test_split_by_length_trades_padding_for_groups() -> None:
    lengths = [1, 2, 3, 100, 101, 400]
    assert split_by_length(lengths, overhead=10**6, max_tokens=10**6) == [6]
    assert split_by_length(lengths, overhead=0, max_tokens=10**6) == [1, 2, 3, 4, 5, 6]
    assert split_by_length(lengths, overhead=50, max_tokens=10**6) == [3, 5, 6]
    # At most 202 padded tokens per group: 100 and 101 still share one, 400 is alone however large.
    assert split_by_length(lengths, overhead=10**6, max_tokens=202) == [3, 5, 6]
    assert split_by_length([7, 7, 7, 7], overhead=1, max_tokens=14) == [2, 4]


def test_decode_groups_cover_every_request_once() -> None:
    block_tables = torch.tensor([[3, 1, -1], [0, -1, -1], [2, 4, 5]], dtype=torch.int32)
    groups = decode_groups(block_tables, torch.tensor([7, 4, 9], dtype=torch.int32), 4, 2, max_tokens=10**6)
    assert sorted(torch.cat([g.rows for g in groups]).tolist()) == [0, 1, 2]
    (group,) = groups  # one group: padding 3 + 5 tokens costs less than a second group's overhead
    assert group.rows.tolist() == [1, 0, 2] and group.length == 9
    assert group.mask is not None and group.mask.sum().item() == 4 + 7 + 9
    # Request 0, KV head 1, position 5: block 1 slot 1 -> cache row (1 * 4 + 1) * 2 + 1.
    assert group.index.view(3, 2, 9)[1, 1, 5].item() == (1 * 4 + 1) * 2 + 1


def test_decode_equal_lengths_need_no_mask() -> None:
    (group,) = decode_groups(torch.tensor([[0, 1], [2, 3]]), torch.tensor([6, 6]), 4, 1, max_tokens=10**6)
    assert group.mask is None
    batch = PagedBatch([6, 6], [1, 1], 4, 4, 1)
    torch.testing.assert_close(run_decode(batch, 0.5), batch.expected(0.5), atol=1e-5, rtol=1e-5)


def test_decode_groups_rebuilt_for_each_step_shared_by_its_layers() -> None:
    """Layers of one step share the groups; the next step (new metadata, longer contexts) gets new ones."""
    backend = TorchAttention()
    first, second = PagedBatch([5, 9], [1, 1], 4, 4, 2), PagedBatch([5, 9], [1, 1], 4, 4, 2)
    second.k_cache.mul_(2)
    second.k, second.q = [k * 2 for k in second.k], [-q for q in second.q]
    meta = first.decode_meta()
    for layer in (first, second):
        layer.k_cache.view(-1, 2, HEAD_DIM)[layer.slot_mapping()] = layer.new_k()
        layer.v_cache.view(-1, 2, HEAD_DIM)[layer.slot_mapping()] = layer.new_v()
        out = backend.decode(torch.cat(layer.q), layer.k_cache, layer.v_cache, meta, 0.5)
        torch.testing.assert_close(out, layer.expected(0.5), atol=1e-5, rtol=1e-5)
    longer = PagedBatch([6, 10], [1, 1], 4, 4, 2)
    torch.testing.assert_close(run_decode(longer, 0.5, backend), longer.expected(0.5), atol=1e-5, rtol=1e-5)


def test_store_kv_skips_padding_slots() -> None:
    backend = TorchAttention()
    k_cache, v_cache = torch.zeros(3, 4, 2, HEAD_DIM), torch.zeros(3, 4, 2, HEAD_DIM)
    k, v = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    backend.store_kv(k, v, k_cache, v_cache, torch.tensor([9, -1, 2]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 2], v[2])
    assert torch.count_nonzero(k_cache.abs().sum((-1, -2))) == 2
    assert torch.count_nonzero(v_cache.abs().sum((-1, -2))) == 2


def test_chunked_prefill_then_decode_matches_one_dense_pass() -> None:
    """A 30-token prompt in chunks of 12, 12, 6, then 3 decode steps, equals causal attention over all 33."""
    num_heads, num_kv_heads, block_size, total = 4, 2, 8, 33
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    table = [4, 0, 3, 1, 5]
    block_tables = torch.tensor([table], dtype=torch.int32)
    k_cache = torch.zeros(6, block_size, num_kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    backend, scale = TorchAttention(), 1 / math.sqrt(HEAD_DIM)
    outs = []
    for start, end in [(0, 12), (12, 24), (24, 30), (30, 31), (31, 32), (32, 33)]:
        pos = torch.arange(start, end)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        backend.store_kv(k[start:end], v[start:end], k_cache, v_cache, slots)
        if end <= 30:
            meta = AttentionMetadata(
                is_prefill=True,
                slot_mapping=slots,
                block_tables=block_tables,
                cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, end], dtype=torch.int32),
                max_seqlen_q=end - start,
                max_seqlen_k=end,
                has_cached_context=start > 0,
            )
            outs.append(backend.prefill(q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, scale))
        else:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=slots,
                block_tables=block_tables,
                context_lens=torch.tensor([end], dtype=torch.int32),
            )
            outs.append(backend.decode(q[start:end], k_cache, v_cache, meta, scale))
    torch.testing.assert_close(torch.cat(outs), dense_attention(q, k, v, scale), atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_with_non_contiguous_query() -> None:
    """Caches may hold a lower precision than q, and q may be a strided view of a packed qkv tensor."""
    ctx_lens, q_lens = [11, 6], [4, 6]
    batch = PagedBatch(ctx_lens, q_lens, 4, 4, 2)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    for i, (n, m) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        batch.k[i], batch.v[i] = batch.k[i].bfloat16().float(), batch.v[i].bfloat16().float()
        cached = batch.slots(i, 0, n - m)
        batch.k_cache.view(-1, 2, HEAD_DIM)[cached] = batch.k[i][: n - m].bfloat16()
        batch.v_cache.view(-1, 2, HEAD_DIM)[cached] = batch.v[i][: n - m].bfloat16()
    packed = torch.cat([torch.cat(batch.q).flatten(1), torch.zeros(sum(q_lens), 8)], dim=1)
    batch_q = packed[:, : 4 * HEAD_DIM].view(-1, 4, HEAD_DIM)
    assert not batch_q.is_contiguous()
    backend = TorchAttention()
    k, v = batch.new_k(), batch.new_v()
    backend.store_kv(k, v, batch.k_cache, batch.v_cache, batch.slot_mapping())
    out = backend.prefill(batch_q, k, v, batch.k_cache, batch.v_cache, batch.prefill_meta(), 0.25)
    torch.testing.assert_close(out, batch.expected(0.25), atol=1e-5, rtol=1e-5)
