"""The CPU default: C kernels for decode (``executor_svc/cpu/csrc/paged_decode.c``) and prefill
(``prefill_attention.c``), torch where they do not apply or the executor's kernel choice found torch faster.

Decode is where a CPU step spends its attention time, and torch can only attend to a gathered copy of
each request's context; the kernel reads keys and values in place through the block tables. torch's SDPA
runs W1's short prompts far below the machine's peak; the prefill kernel is faster there, and torch's flash kernel
on long ones where the CPU multiplies bfloat16 matrices natively (AMX: ``bench.kernels --prompt-tokens``). Keys and
values go into the cache by a C copy too (``executor_svc/cpu/csrc/fused_ops.c``): torch's masked
``index_copy_`` took several ops a layer for a few kilobytes.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from executor_svc.attention.base import AttentionMetadata
from executor_svc.attention.torch_backend import TorchAttention
from executor_svc.cpu.choice import ALL_C, KernelChoice
from executor_svc.cpu.kernels import contiguous_as, kernel_library

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# A mixed step with fewer decode rows runs whole through the C prefill kernel: there one OpenMP region less per layer
# outweighed the decode kernel's in-place reads in some of the rounds measured (docs/benchmarks-history.md).
MIN_SPLIT_DECODES = 16


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads packed, whatever the stride between tokens."""
    return (x.shape[2] == 1 or x.stride(2) == 1) and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def _prefix_sums(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32: 0, then the running sums, as ``cu_seqlens``."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


class CpuAttention(TorchAttention):
    """``TorchAttention`` with decode and prefill in the compiled kernels for float32 and bfloat16, where the
    executor's kernel choice found them the faster: decode by its rows, prefill by its longest context, then, where
    that chooses torch, by each request's own."""

    name = "cpu"
    kernels: KernelChoice = ALL_C

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """``library``: a kernel build other than this machine's own (``kernel_library``), for tests."""
        super().__init__()
        library = library or kernel_library()
        if library is None:
            raise RuntimeError("the CPU attention kernel could not be built (see the log); use the torch backend")
        self._kernel = library.paged_decode
        self._prefill = library.prefill_attention
        self._prefill_supported = library.prefill_attention_supported
        self._store = library.store_kv

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        shapes = k.shape == v.shape and k_cache.shape == v_cache.shape and slot_mapping.shape == k.shape[:1]
        layouts = k.dim() == 3 and k.shape[1:] == k_cache.shape[2:]
        layouts = layouts and k_cache.is_contiguous() and v_cache.is_contiguous()
        rows_contiguous = layouts and k.shape[0] > 0 and _rows_contiguous(k) and _rows_contiguous(v)
        dtypes = k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and slot_mapping.dtype == torch.int64
        if not k.is_cpu or not (shapes and rows_contiguous and dtypes):
            return super().store_kv(k, v, k_cache, v_cache, slot_mapping)
        slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
        outside = self._store(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.shape[1] * k.shape[2],
            k.element_size(),
        )
        if outside:
            raise IndexError(f"{outside} cache slots are past the cache's {k_cache.shape[0]} blocks")

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
        if not self.prefill_applies(q, k, v, k_cache, v_cache, meta):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale)
        if self.kernels.use_c("prefill_attention", meta.max_seqlen_k):
            return self.kernel_prefill(q, k, v, k_cache, v_cache, meta, scale)
        return self._prefill_by_context(q, k, v, k_cache, v_cache, meta, scale)

    def _prefill_by_context(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """A step whose longest context chose torch: each run of consecutive requests whose own contexts choose the
        C kernel still goes through it in one call, on views of its rows, and torch attends the others one by one.
        Otherwise a long prompt would send the short ones beside it through torch, a call each."""
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        short = [self.kernels.use_c("prefill_attention", cu_k[i + 1] - cu_k[i]) for i in range(len(cu_q) - 1)]
        if not any(short):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype)  # contiguous, as kernel_prefill writes its runs' rows
        for in_c, run in itertools.groupby(range(len(short)), key=short.__getitem__):
            requests = list(run)
            if not in_c:
                self.prefill_requests(q, k, v, k_cache, v_cache, meta, scale, requests, out)
                continue
            first, end = requests[0], requests[-1] + 1
            rows = slice(cu_q[first], cu_q[end])
            q_lens = [cu_q[i + 1] - cu_q[i] for i in requests]
            k_lens = [cu_k[i + 1] - cu_k[i] for i in requests]
            part = AttentionMetadata(
                True, meta.slot_mapping[rows], meta.block_tables[first:end], cu_seqlens_q=_prefix_sums(q_lens),
                cu_seqlens_k=_prefix_sums(k_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                has_cached_context=k_lens != q_lens,
            )
            self.kernel_prefill(q[rows], k[rows], v[rows], k_cache, v_cache, part, scale, out[rows])
        return out

    def mixed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Split from ``MIN_SPLIT_DECODES`` decode rows, or where the C prefill kernel would not take the whole step
        (the kernel choice is torch's for its longest context, decode rows' included, or the kernel does not apply;
        the prefill half then goes through ``prefill``, which splits it by request only where the half's longest
        context chooses torch); else the whole step in the C prefill kernel."""
        few = meta.mixed.num_decodes < MIN_SPLIT_DECODES and self.kernels.use_c("prefill_attention", meta.max_seqlen_k)
        if few and self.prefill_applies(q, k, v, k_cache, v_cache, meta):
            return self.kernel_prefill(q, k, v, k_cache, v_cache, meta, scale)
        return super().mixed(q, k, v, k_cache, v_cache, meta, scale)

    def prefill_applies(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        """The kernel's layouts and dtypes, on a build (AVX-512, or AVX2 with FMA) and head_dim it supports."""
        same = q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and q.dtype in KERNEL_DTYPES
        cache = k_cache.dim() == 4 and k_cache.is_contiguous() and v_cache.is_contiguous()
        return (q.device.type == "cpu" and same and (cache or not meta.has_cached_context)
                and all(map(_rows_contiguous, (q, k, v))) and bool(self._prefill_supported(q.shape[2])))

    def kernel_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The C kernel's prefill, where ``prefill_applies``; into ``out`` (contiguous, q's shape) where given."""
        tables = contiguous_as(meta.block_tables, torch.int32)
        cu_q, cu_k = contiguous_as(meta.cu_seqlens_q, torch.int32), contiguous_as(meta.cu_seqlens_k, torch.int32)
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        _, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k.shape[1], k_cache.shape[1] if k_cache.dim() == 4 else 1
        failed = self._prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], cu_q.data_ptr(), cu_k.data_ptr(),
            cu_q.shape[0] - 1, out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size,
            int(q.dtype == torch.bfloat16), scale, torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the CPU prefill attention kernel could not allocate its scratch memory")
        return out

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        supported = k_cache.dtype in KERNEL_DTYPES and q.dtype == k_cache.dtype and k_cache.is_contiguous()
        if not q.is_cpu or not supported or not self.kernels.use_c("decode_attention", q.shape[0]):
            return super().decode(q, k_cache, v_cache, meta, scale)
        return self.kernel_decode(q, k_cache, v_cache, meta, scale)

    def kernel_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """The C kernel's decode, for CPU float32 or bfloat16 ``q`` and contiguous caches of its dtype."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        q = q if q.is_contiguous() else q.contiguous()
        tables, lengths = contiguous_as(meta.block_tables, torch.int32), contiguous_as(meta.context_lens, torch.int32)
        out = torch.empty_like(q)
        failed = self._kernel(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
            out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1],
            int(q.dtype == torch.bfloat16), scale, torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
        return out
