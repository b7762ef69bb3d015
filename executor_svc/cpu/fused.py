"""The decoder layer's elementwise ops as single C kernels on the CPU (``executor_svc/cpu/csrc/fused_ops.c``).

In a CPU decode step these small ops cost as much as attention: torch runs each as several passes over
memory, and in bfloat16 converts to float32 and back at every one. Each function here returns ``None``
when its tensors are not ones the kernels take (not on the CPU, another dtype, rows that are not evenly
strided, or no kernel library on this machine); the layer then runs its torch code, which is also the
reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from executor_svc.cpu import kernels as cpu_kernels

DTYPES = (torch.float32, torch.bfloat16)


def _usable(*tensors: torch.Tensor) -> bool:
    # Attribute reads only: a decode step makes ~120 of these calls, where a view (``x[0]``) or
    # ``x.device`` costs a dispatch each (bench.kernels' 1-row rms_norm shows it).
    dtype = tensors[0].dtype
    if dtype not in DTYPES or not tensors[0].is_cpu or cpu_kernels.kernel_library() is None:  # no build beside a GPU
        return False
    return all(t.is_cpu and t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


def _row_stride(x: torch.Tensor) -> int | None:
    """Elements between rows of ``x`` [rows, ...] whose rows are each contiguous, else None."""
    return x.stride(0) if x.shape[0] > 0 and x[0].is_contiguous() else None


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm of ``x`` (+ ``residual``, updated in place to the sum); the normed rows, or None."""
    tensors = [x, weight] if residual is None else [x, weight, residual]
    if not _usable(*tensors) or x.dim() != 2 or not weight.is_contiguous():  # rows contiguous: stride(-1) is 1
        return None
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cpu_kernels.kernel_library().rms_norm(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], eps, x.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :d]) * x[..., d:] for contiguous ``x``, or None."""
    if not _usable(x) or not x.is_contiguous():
        return None
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    cpu_kernels.kernel_library().silu_and_mul(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], d, x.dtype == torch.bfloat16, torch.get_num_threads()
    )
    return out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place; (q, k), or None."""
    if not _usable(q, k, cos, sin) or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if q.dim() != 3 or k.dim() != 3 or not q.shape[2] == k.shape[2] == cos.shape[1] or cos.shape != sin.shape:
        return None
    q_stride, k_stride = _row_stride(q), _row_stride(k)
    if q_stride is None or k_stride is None or positions.dtype != torch.int64 or not positions.is_contiguous():
        return None
    if not positions.shape == q.shape[:1] == k.shape[:1]:
        return None
    outside = cpu_kernels.kernel_library().rotary(
        q.data_ptr(), q_stride, k.data_ptr(), k_stride, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    if outside:
        raise IndexError(f"{outside} positions are past the rotary table's {cos.shape[0]}")
    return q, k

