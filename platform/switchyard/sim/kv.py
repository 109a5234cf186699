"""Paged KV cache with an LRU prefix cache, modelled on vLLM v1's ``BlockPool``.

Memory is a fixed number of blocks of ``block_size`` tokens. A block that becomes full gets a
hash chained from its parent block's hash and its own token ids, and is registered in the
prefix cache. When its last user frees it, a block keeps its contents and its cache entry and
joins the *free queue* — it is free to be reused, but until then a new request whose prompt
starts with the same tokens can pick it back up instead of recomputing it. Allocation takes
from the head of the free queue (least recently freed first) and evicts the cache entry of
the block it takes, so the cache is LRU and only ever uses memory nobody else needs.

Requests free their blocks tail first, so that under pressure the end of a sequence (the
part least likely to be shared) is evicted before its beginning, as vLLM does.

With ``events`` set to a list, the pool records vLLM's KV-cache events as it changes: a
``BlockRemoved`` per cached block an allocation evicts and ``AllBlocksCleared`` on a reset (the
engine core adds the ``BlockStored`` events, which need the request's tokens, and publishes each
step's list as one batch). A block computed twice (two requests at once, or the last block of a
fully cached prompt, which is always recomputed) is stored and later removed twice, as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from switchyard.kvcache.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, Event

#: Parent hash of a sequence's first block (no cache salt).
ROOT_HASH = 0x5EED
#: Published block hashes are unsigned 64-bit ints, as vLLM's default ``ExternalBlockHash``.
HASH_MASK = (1 << 64) - 1


def external_hash(block_hash: int) -> int:
    """A block hash as KV-cache events carry it (unsigned 64-bit)."""
    return block_hash & HASH_MASK


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash and its token ids.

    Python's ``hash`` of a tuple of ints is not salted (only ``str``/``bytes`` hashing is), so
    the value is stable and the cache key never leaves the process anyway.
    """
    return hash((parent, tuple(tokens)))


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks of ``tokens``, following the block hashed ``parent``."""
    hashes: list[int] = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = chain_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Fixed pool of KV blocks with reference counts and a hash -> block prefix cache.

    Args:
        num_blocks: Capacity in blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        #: Free blocks in eviction order (head = next to be reused).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self.evictions = 0
        #: Where KV-cache events are recorded (None: not recorded).
        self.events: list[Event] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never used, or cached but unreferenced)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, as vLLM's ``kv_cache_usage_perc`` (evictable = free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of ``hashes`` from the start (not touched)."""
        found: list[int] = []
        cached = self._cached
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` currently sit in the free queue."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, pulling unreferenced ones off the free queue."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cache entries.

        Raises:
            ValueError: Fewer than ``n`` blocks are free (callers check ``num_free`` first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} KV blocks, {len(self._free)} free")
        out: list[int] = []
        free, ref, hashes, cached, events = self._free, self._ref, self._hash, self._cached, self.events
        for _ in range(n):
            b, _unused = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                    self.evictions += 1
                hashes[b] = None
                if events is not None:
                    events.append(BlockRemoved(block_hashes=[h & HASH_MASK], medium=MEDIUM_GPU, group_idx=0))
            ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first; unreferenced blocks stay cached."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def register(self, block: int, block_hash: int) -> None:
        """Record that ``block`` now holds the full block identified by ``block_hash``.

        If another block already holds the same content (two requests computed it at once),
        the first one stays the cache entry; this one only remembers its hash, so that its
        eviction is reported as vLLM reports it.
        """
        if block_hash not in self._cached:
            self._cached[block_hash] = block
        self._hash[block] = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM does: only when no block is in use.

        Returns:
            Whether the cache was reset (False while a request holds blocks).
        """
        if self.num_used:
            return False
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
