"""KV-cache blocks: reference counts and a chained-hash prefix cache."""

from __future__ import annotations

from array import array
from collections import deque

import xxhash

from scheduler_svc.core.sequence import Sequence

NO_HASH = -1


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []


def chain_hash(token_ids: list[int], prefix_hash: int) -> int:
    """xxh64 of the previous block's hash followed by this block's token ids."""
    h = xxhash.xxh64()
    if prefix_hash != NO_HASH:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class BlockManager:
    """Hands out fixed-size blocks and finds computed prefixes to share.

    A block's hash is registered only after its KV has been computed (in
    ``hash_blocks``), and a free block keeps its registration until it is
    reused, so a prompt seen before can still hit it.

    A hash names every block that holds its KV: two sequences sharing a prefix
    in one step each compute their own copy, and both stay findable, so a hit
    survives as long as any copy does (with one name per hash, evicting the
    named copy loses the hit while its twin still holds the KV). Merging the
    twin into the named block instead would rewrite a block table the executor
    already holds, which the plan protocol (appends only) cannot say. A reused
    block drops only its own entry; a hit shares a copy in use before reviving
    a free one, so it never holds a block more than it must.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Registered blocks by hash, in registration order; a block is in at most one list, once.
        self.hash_to_block_ids: dict[int, list[int]] = {}
        self.num_cached_blocks = 0
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self) -> int:
        """Hand out the least recently freed block, dropping its prefix-cache registration."""
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != NO_HASH:
            copies = self.hash_to_block_ids[block.hash]
            copies.remove(block_id)
            if not copies:
                del self.hash_to_block_ids[block.hash]
            self.num_cached_blocks -= 1
        block.hash = NO_HASH
        block.token_ids = []
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def _find(self, h: int, token_ids: list[int]) -> int | None:
        """A block holding the KV of ``token_ids`` after the prefix that chained to ``h``: the copy
        registered last, as nano-vLLM's map (last write wins) would name, but one in use before a
        free one, since sharing it takes no block."""
        found = None
        for block_id in reversed(self.hash_to_block_ids.get(h, ())):
            block = self.blocks[block_id]
            if block.token_ids == token_ids:
                if block.ref_count:
                    return block_id
                if found is None:
                    found = block_id
        return found

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest computed prefix, never the prompt's last block; none for a prompt whose
        logprobs were asked, since only computing a token gives its logprob."""
        hits: list[int] = []
        if seq.params.prompt_logprobs is not None:
            return hits
        h = NO_HASH
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = chain_hash(token_ids, h)
            block_id = self._find(h, token_ids)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> int:
        """Number of prefix-cache hit blocks if ``seq`` fits now, else -1."""
        hits = self._cached_prefix(seq)
        num_new_blocks = seq.num_blocks - sum(1 for b in hits if b in self.used_block_ids)
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        hits = self._cached_prefix(seq)[:num_cached_blocks]
        assert len(hits) == num_cached_blocks
        for block_id in hits:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
                block.ref_count = 1
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def append_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold the KV of its first ``num_tokens`` tokens. False, taking
        nothing, when too few blocks are free: the scheduler then preempts and asks again."""
        table = seq.block_table
        num_new_blocks = (num_tokens + self.block_size - 1) // self.block_size - len(table)
        if num_new_blocks > len(self.free_block_ids):
            return False
        for _ in range(num_new_blocks):
            table.append(self._take_free_block())
        return True

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def hash_blocks(self, seq: Sequence, first_token: int, end_token: int) -> None:
        """Register the blocks that computing tokens [first_token, end_token) filled; their KV now exists.

        These blocks were fresh when taken (a hit is never recomputed), so none is registered yet;
        a copy another sequence computed in the same step joins the same hash.
        """
        start = first_token // self.block_size
        end = end_token // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else NO_HASH
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = chain_hash(token_ids, h)
            block.hash = h
            block.token_ids = token_ids
            self.hash_to_block_ids.setdefault(h, []).append(block.block_id)
        self.num_cached_blocks += end - start
