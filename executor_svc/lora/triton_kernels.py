"""The LoRA update in Triton, for CUDA: each row through its own adapter's factors, in two kernels.

``shrink``: t[row] = x[row] A[slot] (A [slots, in, width]); ``expand``: y[row] += t[row] B[slot] (B [slots, width,
out], the adapter's scaling multiplied in at load); ``slot`` is the row's (-1: the base model, a row left alone). One
program per row and tile, reading its adapter's factors through the row's slot (a gathered matrix-vector product, as
decode rows need): rows of different adapters need no sorting into segments, and the two launches take the same time
whatever the adapters.
Products are summed in float32 and added to y with one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, t_ptr, in_features, width, stride_x, stride_as, stride_t,
                   BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:  # the base model's row
        return
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < in_features, other=0.0).to(tl.float32)
        a_mask = (ks[:, None] < in_features) & (cols[None, :] < width)
        a = tl.load(a_ptr + slot * stride_as + ks[:, None] * width + cols[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(x[:, None] * a.to(tl.float32), axis=0)
    tl.store(t_ptr + row * stride_t + cols, acc, mask=cols < width)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, slots_ptr, y_ptr, width, out_features, stride_t, stride_bs, stride_y,
                   BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for w0 in range(0, width, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        t = tl.load(t_ptr + row * stride_t + ws, mask=ws < width, other=0.0)
        b_mask = (ws[:, None] < width) & (ns[None, :] < out_features)
        b = tl.load(b_ptr + slot * stride_bs + ws[:, None] * out_features + ns[None, :], mask=b_mask, other=0.0)
        acc += tl.sum(t[:, None] * b.to(tl.float32), axis=0)
    out_mask = ns < out_features
    y = tl.load(y_ptr + row * stride_y + ns, mask=out_mask, other=0.0)
    tl.store(y_ptr + row * stride_y + ns, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor) -> None:
    """``y[r] += (x[r] a[s]) b[s]`` for every row r whose slot s = ``row_slots[r]`` is not -1.

    ``x`` [rows, in] and ``y`` [rows, out] with unit column stride; ``a`` [slots, in, width] and ``b`` [slots, width,
    out] contiguous; ``row_slots`` int32 [rows]."""
    rows, in_features = x.shape
    width, out_features = b.shape[1], b.shape[2]
    if rows == 0 or width == 0:
        return
    t = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    block_w = triton.next_power_of_2(min(width, 64))
    _shrink_kernel[(rows, triton.cdiv(width, block_w))](
        x, a, row_slots, t, in_features, width, x.stride(0), a.stride(0), t.stride(0),
        BLOCK_K=64, BLOCK_W=block_w)
    _expand_kernel[(rows, triton.cdiv(out_features, 64))](
        t, b, row_slots, y, width, out_features, t.stride(0), b.stride(0), y.stride(0),
        BLOCK_W=block_w, BLOCK_N=64)
