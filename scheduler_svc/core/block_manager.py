"""KV-cache blocks: reference counts and a chained-hash prefix cache."""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import deque

import xxhash

from scheduler_svc.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from scheduler_svc.core.sequence import Sequence

NO_HASH = -1
# This process's secret, which keys every hash: nobody outside can compute one, so nobody can craft tokens or a
# cache salt whose chain collides with another request's prefix (xxh64 is no cryptographic hash). The hashes are the
# cache's own: routers key blocks by the tokens the events carry, never by recomputing these.
HASH_KEY = secrets.token_bytes(16)
HASH_SEED = int.from_bytes(HASH_KEY[:8], "little")


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []


def chain_hash(token_ids: list[int], prefix_hash: int) -> int:
    """xxh64, keyed by ``HASH_SEED``, of the previous block's hash followed by this block's token ids."""
    h = xxhash.xxh64(seed=HASH_SEED)
    if prefix_hash != NO_HASH:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def root_hash(seq: Sequence) -> int:
    """What a sequence's first block chains from: nothing for the base model unsalted, else its adapter's id and its
    request's cache salt, so that every block hash of an adapter's sequence differs from the base model's and every
    other adapter's (their KV does), and a salted prompt hits only blocks computed under the same salt."""
    if not seq.lora_id and not seq.cache_salt:
        return NO_HASH
    # A keyed BLAKE2b, once per sequence: a salt, the caller's own text, cannot be chosen to hit a given root.
    key = b"lora" + seq.lora_id.to_bytes(8, "little") + b"salt" + seq.cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=HASH_KEY).digest(), "little")


class BlockManager:
    """Hands out fixed-size blocks and finds computed prefixes to share.

    A block's hash is registered only after its KV has been computed (in ``hash_blocks``), and a free block keeps
    its registration until it is reused, so a prompt seen before can still hit it.

    Every computed copy of a prefix stays registered (two sequences sharing a prefix in one step compute one each),
    but what is scheduled follows nano-vLLM's cache: ``named`` holds, per hash, the one copy its map names (registered
    last, until that block is reused). A sequence is admitted, charged against the token budget and given blocks
    exactly as nano-vLLM would, so the schedule is nano-vLLM's step for step. The other copies only save work that
    changes nothing else: a sequence whose whole prompt is computed in the step (a chunk would end elsewhere)
    revives a free copy nano-vLLM no longer names where nano-vLLM takes a fresh block, and that fresh block takes
    the copy's place in the free list, keeping its own KV. Sharing a copy in use instead would hold a block less
    than nano-vLLM and admit a sequence nano-vLLM keeps waiting, into a cache the next decode needs: preempted, it
    is computed again, more prefill, not less.

    While someone listens (``listen``), the cache's entries as they come and go are recorded in ``events``
    (``core.kv_events``); otherwise recording costs one check per registered block and per reused one.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Registered blocks by hash, in registration order; a block is in at most one list, once.
        self.hash_to_block_ids: dict[int, list[int]] = {}
        # Per hash, the copy nano-vLLM's map names: registered last and not reused since.
        self.named: dict[int, int] = {}
        # Per sequence, the copies it revived: named when its step settles, as nano-vLLM's fresh blocks would be.
        self.revived: dict[int, list[int]] = {}
        self.num_cached_blocks = 0
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # The prefix cache's events since the last ``take_events``; None while nobody listens.
        self.events: list[KvEvent] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def listen(self) -> None:
        """Record the prefix cache's events from now on (already recording: nothing changes)."""
        if self.events is None:
            self.events = []

    def carry_listener(self, old: BlockManager) -> None:
        """This empty cache replaces ``old`` (a restarted executor's): whoever listened to it now hears that nothing
        is cached, then this cache's events."""
        if old.events is not None:
            self.events = [*old.events, AllBlocksCleared()]

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first (none while nobody listens)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def _take_free_block(self) -> int:
        """Hand out the least recently freed block, dropping its prefix-cache registration."""
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != NO_HASH:
            self._unregister(block)
        block.token_ids = []
        self._use(block_id)
        return block_id

    def _unregister(self, block: Block) -> None:
        """Drop ``block``'s prefix-cache registration; the entry is removed with its last copy."""
        h = block.hash
        copies = self.hash_to_block_ids[h]
        copies.remove(block.block_id)
        if not copies:
            del self.hash_to_block_ids[h]
            if self.events is not None:
                last = self.events[-1] if self.events else None
                if type(last) is BlockRemoved:
                    last.block_hashes.append(h)
                else:
                    self.events.append(BlockRemoved([h]))
        self._unname(block.block_id)
        self.num_cached_blocks -= 1
        block.hash = NO_HASH

    def flush(self) -> int:
        """Drop the prefix-cache entries no request holds (their blocks stay free, now without KV worth finding);
        the blocks requests hold keep theirs, since their sequences chain new hashes onto them. Returns the number
        of blocks dropped; the events say which entries went, or (none left) that nothing is cached."""
        dropped = 0
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.hash != NO_HASH:
                self._unregister(block)
                block.token_ids = []
                dropped += 1
        if self.events is not None and dropped and not self.hash_to_block_ids:
            self.events[:] = [AllBlocksCleared()]  # the state every event not yet taken led to
        return dropped

    def _use(self, block_id: int) -> None:
        self.blocks[block_id].ref_count = 1
        self.used_block_ids.add(block_id)

    def _unname(self, block_id: int) -> None:
        """nano-vLLM reuses ``block_id``: its map no longer names it."""
        h = self.blocks[block_id].hash
        if h != NO_HASH and self.named.get(h) == block_id:
            del self.named[h]

    def _revive_for_head(self, block_id: int) -> None:
        """Take the free copy ``block_id`` where nano-vLLM takes the head of the free list: the head moves to the
        copy's place, keeping its KV (findable here, no longer named), so the free list stays nano-vLLM's."""
        free = self.free_block_ids
        head = free.popleft()
        if head != block_id:
            free[free.index(block_id)] = head
            self._unname(head)
        self._use(block_id)

    def _free_copy(self, h: int, token_ids: list[int]) -> int | None:
        """A free block holding ``token_ids`` after the prefix that chained to ``h`` that nano-vLLM does not name."""
        for block_id in reversed(self.hash_to_block_ids.get(h, ())):
            block = self.blocks[block_id]
            if not block.ref_count and block.token_ids == token_ids and self.named.get(h) != block_id:
                return block_id
        return None

    def _cached_prefix(self, seq: Sequence, revive: bool) -> tuple[list[int], int]:
        """Block ids of the longest computed prefix, never the prompt's last block, and how many of them nano-vLLM
        names; with ``revive``, free copies it does not name continue the prefix. None for a prompt whose logprobs
        were asked, since only computing a token gives its logprob."""
        hits: list[int] = []
        if seq.params.prompt_logprobs is not None:
            return hits, 0
        num_named = -1
        h = root_hash(seq)
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = chain_hash(token_ids, h)
            if num_named < 0:
                block_id = self.named.get(h)
                if block_id is not None and self.blocks[block_id].token_ids == token_ids:
                    hits.append(block_id)
                    continue
                num_named = len(hits)
                if not revive:
                    break
            block_id = self._free_copy(h, token_ids)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) if num_named < 0 else num_named

    def can_allocate(self, seq: Sequence) -> int:
        """Number of prefix-cache hit blocks nano-vLLM finds if ``seq`` fits now, else -1."""
        hits, _ = self._cached_prefix(seq, revive=False)
        num_new_blocks = seq.num_blocks - sum(1 for b in hits if self.blocks[b].ref_count)
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int, revive: bool = False) -> None:
        """Give ``seq`` the ``num_cached_blocks`` hits ``can_allocate`` counted, then fresh blocks; with ``revive``
        (its whole prompt is computed this step), free copies nano-vLLM does not name stand in for fresh blocks."""
        assert not seq.block_table
        hits, num_named = self._cached_prefix(seq, revive)
        assert num_named == num_cached_blocks
        for block_id in hits[:num_named]:
            block = self.blocks[block_id]
            if block.ref_count:
                block.ref_count += 1
            else:
                self.free_block_ids.remove(block_id)
                self._use(block_id)
        for block_id in hits[num_named:]:
            self._revive_for_head(block_id)
        if len(hits) > num_named:
            self.revived[seq.seq_id] = hits[num_named:]
        seq.block_table.extend(hits)
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = len(hits) * self.block_size

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

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Cut ``seq``'s block table to its first ``num_blocks`` blocks (a verification's rejected proposals left
        the rest empty): they were taken fresh and never hashed, and are free again at once."""
        table = seq.block_table
        while len(table) > num_blocks:
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash == NO_HASH
            self.used_block_ids.remove(block.block_id)
            self.free_block_ids.append(block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        self.revived.pop(seq.seq_id, None)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def hash_blocks(self, seq: Sequence, first_token: int, end_token: int) -> None:
        """Register the blocks that computing tokens [first_token, end_token) filled; their KV now exists. The
        copies ``seq`` revived are named now too, in the order nano-vLLM registers the blocks it computed instead.

        These blocks were fresh when taken (a hit is never recomputed), so none is registered yet;
        a copy another sequence computed in the same step joins the same hash, and is named last.
        """
        for block_id in self.revived.pop(seq.seq_id, ()):
            self.named[self.blocks[block_id].hash] = block_id
        start = first_token // self.block_size
        end = end_token // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else root_hash(seq)
        events, stored = self.events, None
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            parent, h = h, chain_hash(token_ids, h)
            block.hash = h
            block.token_ids = token_ids
            copies = self.hash_to_block_ids.setdefault(h, [])
            if events is not None:  # a new entry continues this call's chain of them, or starts one
                if copies:
                    stored = None
                elif stored is None:
                    stored = BlockStored([h], None if i == 0 else parent, list(token_ids), self.block_size,
                                         seq.lora_id or None, cache_salt=seq.cache_salt or None)
                    events.append(stored)
                else:
                    stored.block_hashes.append(h)
                    stored.token_ids += token_ids
            copies.append(block.block_id)
            self.named[h] = block.block_id
        self.num_cached_blocks += end - start
