"""The paged KV layout and the interface every attention backend implements.

KV cache, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size``;
``slot_mapping`` gives that slot for every token computed this step.

A step is prefill, decode, or mixed (``--scheduling-policy mixed``: decode rows
and prefill chunks in one forward pass). Prefill tokens are packed ("varlen"):
request ``i`` contributes the query tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``,
which are the *last* tokens of its context of ``cu_seqlens_k[i+1] -
cu_seqlens_k[i]`` tokens (cached prefix and earlier chunks come first and are
read from the cache). Decode has one query token per request whose context is
``context_lens[i]`` tokens, itself included. Attention is causal throughout.

A mixed step is packed decode rows first: its metadata describes the whole step
as a prefill (every backend's ``prefill`` could run it so) and, in ``mixed``, its
two halves, so that the first ``num_decodes`` rows can go through ``decode``
(which reads each context in place, where a prefill kernel tiles or copies it for
one query) and the rest through ``prefill`` (``split_attention``); the linear
layers still run once over all rows. Each backend's ``mixed`` chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # [num_tokens] int64: cache slot of each token computed this step.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] int32, padded with -1.
    block_tables: torch.Tensor
    # Prefill only: [num_seqs + 1] int32 prefix sums of query and context lengths.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # True when some prefill request reads context from the cache (a prefix hit
    # or an earlier chunk), so attention cannot use only this step's k and v.
    has_cached_context: bool = False
    # Decode only: [num_seqs] int32 context length of each request.
    context_lens: torch.Tensor | None = None
    # A mixed step (a prefill step whose first rows are decode rows): its halves' own metadata.
    mixed: MixedSplit | None = None

    def to(self, device: torch.device, pinned: bool = False) -> AttentionMetadata:
        """A copy on ``device``; tensors are copied without a wait, as the step's other inputs are (``pinned``:
        through page-locked memory, ``ModelInput.to``)."""
        moved = {name: to_device(value, device, pinned) if isinstance(value, torch.Tensor) else value
                 for name, value in vars(self).items()}
        if self.mixed is not None:
            moved["mixed"] = MixedSplit(self.mixed.num_decodes, self.mixed.decode.to(device, pinned),
                                        self.mixed.prefill.to(device, pinned))
        return AttentionMetadata(**moved)


def to_device(tensor: torch.Tensor, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """``tensor`` on ``device`` without a wait; ``pinned``: copied through page-locked memory where it goes to an
    accelerator, so that the copy does not wait for the work queued before it (``ModelInput.to``)."""
    return (tensor.pin_memory() if pinned and device.type != "cpu" else tensor).to(device, non_blocking=True)


@dataclass
class MixedSplit:
    """A mixed step's halves: rows ``[0, num_decodes)`` are decode rows, one per request, and the rest prefill
    chunks whose ``cu_seqlens`` count from row ``num_decodes``."""

    num_decodes: int
    decode: AttentionMetadata
    prefill: AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` of shape [num_tokens, num_kv_heads, head_dim] into their slots."""
        ...

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
        """Causal varlen attention: q [num_tokens, num_heads, head_dim] -> same shape.

        Called after ``store_kv``, so the cache already holds this step's keys.
        """
        ...

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """One query per request: q [num_seqs, num_heads, head_dim] -> same shape."""
        ...

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
        """A mixed step (``meta.mixed`` set), with ``prefill``'s arguments: its rows in one output, however the
        backend runs them (most split them, ``split_attention``)."""
        ...


def split_attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A mixed step's decode rows through ``backend.decode`` and its prefill chunks through ``backend.prefill``, into
    one output: the ``mixed`` of a backend that always splits."""
    split = meta.mixed
    d = split.num_decodes
    decoded = backend.decode(q[:d], k_cache, v_cache, split.decode, scale)
    return torch.cat([decoded, backend.prefill(q[d:], k[d:], v[d:], k_cache, v_cache, split.prefill, scale)])


class SplitsMixed:
    """The ``mixed`` of a backend that always splits (``split_attention``): its decode path reads each context in
    place, or in groups, where its prefill would attend a decode row as a prompt of one."""

    def mixed(
        self: AttentionBackend,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return split_attention(self, q, k, v, k_cache, v_cache, meta, scale)


def attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The step's attention after ``store_kv``, by the kind of step."""
    if meta.mixed is not None:
        return backend.mixed(q, k, v, k_cache, v_cache, meta, scale)
    if meta.is_prefill:
        return backend.prefill(q, k, v, k_cache, v_cache, meta, scale)
    return backend.decode(q, k_cache, v_cache, meta, scale)
