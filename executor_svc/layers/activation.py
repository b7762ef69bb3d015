"""SiLU-and-mul over the packed gate-up projection (one C kernel on the CPU: ``cpu_fused.silu_and_mul``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers import cpu_fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_fused.silu_and_mul(x)
        if fused is not None:
            return fused
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
