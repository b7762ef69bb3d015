"""Rotary position embedding (the rotate-half form of Llama/Qwen), from a precomputed table.

cos and sin are computed in float32 from the positions, then cast to the
model dtype, in the same order as transformers so float32 results match, with
the frequency scalings transformers computes for these models (linear, Llama 3's,
YaRN's, with its attention factor on cos and sin). On the CPU one C kernel rotates
q and k in place (``executor_svc.cpu.fused.rotary``) where the executor's kernel
choice says it is the faster.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu.choice import ALL_C, KernelChoice
from executor_svc.runtime.config import RopeScaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Each rotated pair's frequency, and the factor cos and sin are scaled by (YaRN's; 1.0 for the others)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factor, kind = scaling.factor, scaling.rope_type
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":  # low frequencies divided by factor, high ones kept, a smooth blend between
        old_len = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / scaling.high_freq_factor) * ~(wavelen > old_len / scaling.low_freq_factor)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    return inv_freq, 1.0


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies below the correction range, extrapolated above it, ramped between."""
    factor, old_len = scaling.factor, scaling.original_max_position_embeddings
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    kernels: KernelChoice = ALL_C

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq, attention = inverse_frequencies(head_dim, theta, scaling or RopeScaling())
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] by their positions."""
        if self.kernels.use_c("rotary", positions.shape[0]):
            fused = cpu_fused.rotary(positions, q, k, self.cos, self.sin)
            if fused is not None:
                return fused
        return self.torch_forward(positions, q, k)

    def torch_forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
