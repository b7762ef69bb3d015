"""RMSNorm with the optional residual add fused in front, computed in float32 like transformers.

On the CPU one C kernel does both (``executor_svc.cpu.fused.rms_norm``) where the executor's kernel choice says
it is the faster (``executor_svc/cpu/choice.py``); the torch code here is the reference and the other choice.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.cpu import fused as cpu_fused
from executor_svc.cpu.choice import ALL_C, KernelChoice


class RMSNorm(nn.Module):
    kernels: KernelChoice = ALL_C

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), the sum written into
        ``residual`` (the decoder's running residual, which nothing else holds)."""
        if self.kernels.use_c("rms_norm", x.shape[0]):
            fused = cpu_fused.rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused if residual is None else (fused, residual)
        return self.torch_forward(x, residual)

    def torch_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual
