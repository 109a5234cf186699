"""The approximate prefix index: which endpoints were last sent which prompt blocks, and when.

The gateway's guess of what each engine's prefix cache holds (blocks are named by
:func:`switchyard.decide.prefix.block_hashes`): a block stays where it was last sent until the
TTL passes. Owned by an executor; the prefix-affinity scorer reads and records it through
:class:`switchyard.decide.views.PrefixMemory`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Block hash → the endpoints that served it and when; bounded in entries and age (a block no endpoint
    has served within ``ttl_s`` is dropped at the next :meth:`record`)."""

    __slots__ = ("_blocks", "capacity", "ttl_s")

    def __init__(self, capacity: int = 200_000, ttl_s: float = 600.0) -> None:
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self.capacity = capacity
        self.ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, hashes: Sequence[bytes], url: str, now: float) -> None:
        """Remember that ``url`` holds every block of ``hashes`` as of ``now``."""
        blocks = self._blocks
        for h in hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {url: now}
            else:
                holders[url] = now
                blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        # Blocks are kept in the order they were last recorded, so the ones no endpoint has served within
        # the TTL are at the front: dropping them keeps the index as small as the traffic of one TTL (the
        # soak showed the capacity alone let it grow for over half an hour at 30 requests/s).
        oldest = now - self.ttl_s
        while blocks:
            first = next(iter(blocks.values()))
            if max(first.values()) >= oldest:
                break
            blocks.popitem(last=False)

    def affinity(self, hashes: Sequence[bytes], urls: Sequence[str], now: float) -> dict[str, float]:
        """For each of ``urls``, the fraction of ``hashes`` it holds as an unbroken leading run at ``now``."""
        result = dict.fromkeys(urls, 0.0)
        if not hashes:
            return result
        oldest = now - self.ttl_s
        alive = set(urls)
        for depth, h in enumerate(hashes, start=1):
            holders = self._blocks.get(h)
            if holders is None:
                break
            alive = {u for u in alive if holders.get(u, -math.inf) >= oldest}
            if not alive:
                break
            for u in alive:
                result[u] = depth / len(hashes)
        return result
