"""Tensor parallelism over ``torch.distributed``: NCCL on CUDA, gloo on CPU.

Rank 0 owns the request table and serves gRPC; each step it broadcasts the
prepared model input, every rank runs the same forward over its head shards
(its own KV cache holds those heads), and the logits are gathered so rank 0
can sample. With one rank nothing here communicates.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum the partial results of a row-parallel layer across ranks (in place)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard of the last dimension (vocab-parallel logits)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (KV block counts must agree)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_object(obj: Any) -> Any:
    """Rank 0 sends ``obj``; every rank returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def free_init_method() -> str:
    """A TCP rendezvous address on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_group(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def spawn_workers(target: Callable[..., None], world_size: int, args: tuple) -> list[mp.Process]:
    """Start ranks 1..world_size-1 as ``target(rank, *args)`` in fresh processes."""
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(1, world_size)]
    for worker in workers:
        worker.start()
    return workers
