"""SiLU-and-mul over the packed gate-up projection (on the CPU one C kernel, ``executor_svc.cpu.fused.silu_and_mul``,
where the executor's kernel choice says it is the faster)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu.choice import ALL_C, KernelChoice


class SiluAndMul(nn.Module):
    kernels: KernelChoice = ALL_C

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``rows``: the row count the kernel choice goes by (default: ``x``'s), a whole step's for a chunk of it."""
        if self.kernels.use_c("silu_and_mul", x.numel() // max(x.shape[-1], 1) if rows is None else rows):
            fused = cpu_fused.silu_and_mul(x)
            if fused is not None:
                return fused
        return self.torch_forward(x)

    @staticmethod
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
