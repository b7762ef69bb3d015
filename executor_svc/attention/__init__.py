"""Attention backends over one paged KV layout (see ``base.py``), and how one is chosen."""

from __future__ import annotations

import importlib
import os

import torch

from executor_svc.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "available_backends", "get_backend"]

# Every backend there is; which of them run depends on the device (``available_backends``).
BACKENDS = ("cpu", "torch", "triton", "flash_attn")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on ``device``, best first.

    On the CPU, ``cpu`` (torch plus a C decode kernel) needs the kernel built, which happens here the first
    time on a machine. Triton runs only under its interpreter (``TRITON_INTERPRET=1``): useful for tests,
    too slow to serve, so it comes last.
    """
    if torch.device(device).type == "cuda":
        # Each kernel backend is named after the module it needs.
        kernel_backends = [name for name in ("flash_attn", "triton") if _importable(name)]
        return [*kernel_backends, "torch"]
    from executor_svc.cpu.kernels import kernel_library

    choices = ["cpu", "torch"] if kernel_library() is not None else ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1" and _importable("triton"):
        choices.append("triton")
    return choices


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called ``name``; ``None`` or ``"auto"`` picks the best available on ``device``."""
    choices = available_backends(device)
    if name is None or name == "auto":
        name = choices[0]
    if name not in choices:
        raise ValueError(
            f"attention backend {name!r} is not available on {torch.device(device)}; choose one of {choices}"
        )
    if name == "flash_attn":
        from executor_svc.attention.flash_backend import FlashAttention

        return FlashAttention()
    if name == "triton":
        from executor_svc.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from executor_svc.attention.cpu_backend import CpuAttention

        return CpuAttention()
    from executor_svc.attention.torch_backend import TorchAttention

    return TorchAttention()
