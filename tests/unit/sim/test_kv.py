"""The block pool and its LRU prefix cache."""

from __future__ import annotations

import pytest

from switchyard.sim.kv import ROOT_HASH, BlockPool, chain_hash


def test_allocate_and_free_count_blocks() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert pool.num_used == 3
    assert pool.usage == pytest.approx(3 / 8)
    pool.free(blocks)
    assert pool.num_used == 0
    with pytest.raises(ValueError, match="free"):
        pool.allocate(9)


def test_a_freed_block_stays_cached_until_its_space_is_needed() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    h = chain_hash(ROOT_HASH, range(16))
    pool.register(block, h)
    pool.free([block])
    assert pool.lookup([h]) == [block]  # evictable, still a hit
    assert pool.num_free == 2
    pool.allocate(1)  # the never-used block goes first
    assert pool.lookup([h]) == [block]
    pool.allocate(1)  # now the cached block is needed
    assert pool.lookup([h]) == []
    assert pool.evictions == 1


def test_touch_takes_a_cached_block_off_the_free_queue() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.register(block, 42)
    pool.free([block])
    pool.touch([block])
    assert pool.num_free == 1
    pool.allocate(1)
    assert pool.lookup([42]) == [block]  # in use: never evicted


def test_eviction_is_least_recently_freed_first_and_tail_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    for i, blk in enumerate(a + b):
        pool.register(blk, 100 + i)
    pool.free(a)  # freed first: evicted first; within a, its tail goes before its head
    pool.free(b)
    [first] = pool.allocate(1)
    assert first == a[1]
    assert pool.lookup([100]) == [a[0]]
    assert pool.lookup([101]) == []
