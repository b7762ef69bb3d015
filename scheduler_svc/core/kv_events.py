"""What the prefix cache tells a router: which blocks it can serve a prompt from, as they come and go.

The block manager records these plain events while someone listens (``BlockManager.listen``); the engine loop
numbers them in batches (``engine.kv_events``) and the API layer ships them (gRPC ``SubscribeKvEvents``, ZMQ in
vLLM's msgpack format). A hash is the prefix cache's own chained xxh64 (``block_manager.chain_hash``), an unsigned
64-bit integer: a block's hash covers every token before it, so a router matching a prompt's blocks in order
matches its prefix.

An entry is stored when its first copy's hash is registered and removed when its last copy's is dropped: a
router sees each cached prefix once, however many physical copies the cache keeps of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Full blocks whose KV was computed, now prefix-cache entries: a chain, each block the parent of the next.

    ``token_ids`` holds ``block_size`` tokens per hash, in order; ``parent_block_hash`` is the hash of the block
    before the first one (None: the first block of a prompt). ``lora_id``: the adapter whose KV they hold (None: the
    base model's), whose name the engine fills in (``KvEventLog.collect``), as a router keys blocks by it;
    ``cache_salt``: the salt of the request that computed them (None: unsalted), which went into the chain's root.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Prefix-cache entries gone: the last copy of each was reused for other tokens, or flushed."""

    block_hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is cached any more: the executor restarted with an empty cache, or a flush left no entry."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
