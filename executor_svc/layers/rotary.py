"""Rotary position embedding (the rotate-half form of Llama/Qwen), from a precomputed table.

cos and sin are computed in float32 from the positions, then cast to the
model dtype, in the same order as transformers so float32 results match. On
the CPU one C kernel rotates q and k in place (``executor_svc.cpu.fused.rotary``)
where the executor's kernel choice says it is the faster.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu.choice import ALL_C, KernelChoice


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    kernels: KernelChoice = ALL_C

    def __init__(self, head_dim: int, max_position: int, theta: float, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

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
