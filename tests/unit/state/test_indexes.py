"""The stateful scorers' memory: the approximate prefix index and the session index, bounded and aged."""

from __future__ import annotations

from switchyard.decide.prefix import BLOCK_CHARS, block_hashes
from switchyard.state.prefix import PrefixIndex
from switchyard.state.sessions import SessionIndex

U1, U2, U3 = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def test_prefix_index_scores_the_leading_run_an_endpoint_holds() -> None:
    index = PrefixIndex(capacity=100, ttl_s=60)
    shared = "s" * BLOCK_CHARS * 2
    first = block_hashes(shared + "1" * BLOCK_CHARS * 2)
    second = block_hashes(shared + "2" * BLOCK_CHARS * 2)
    index.record(first, U1, now=0)
    assert index.affinity(first, [U1, U2], now=1) == {U1: 1.0, U2: 0.0}
    assert index.affinity(second, [U1, U2], now=1) == {U1: 0.5, U2: 0.0}
    index.record(second, U2, now=2)
    assert index.affinity(second, [U1, U2], now=3) == {U1: 0.5, U2: 1.0}
    # Entries older than the TTL do not count.
    assert index.affinity(first, [U1], now=61) == {U1: 0.0}
    assert index.affinity([], [U1], now=0) == {U1: 0.0}


def test_prefix_index_is_bounded() -> None:
    index = PrefixIndex(capacity=3, ttl_s=60)
    hashes = block_hashes("q" * BLOCK_CHARS * 5)
    index.record(hashes, U1, now=0)
    assert len(index) == 3
    # The oldest (leading) blocks were evicted, so the prompt's leading run is gone.
    assert index.affinity(hashes, [U1], now=1) == {U1: 0.0}


def test_prefix_index_drops_blocks_older_than_its_ttl() -> None:
    index = PrefixIndex(capacity=1000, ttl_s=60)
    old, kept = block_hashes("o" * BLOCK_CHARS * 4), block_hashes("k" * BLOCK_CHARS * 3)
    index.record(old, U1, now=0)
    index.record(kept[:1], U1, now=10)
    index.record(old[:1], U2, now=30)  # served again: that block stays, the rest of `old` goes at 61
    index.record(kept, U2, now=61)
    assert len(index) == 1 + 3  # old[0] (U2 at 30) and the three of `kept`
    assert index.affinity(old, [U1, U2], now=62) == {U1: 0.0, U2: 0.25}
    index.record(kept, U1, now=200)
    assert len(index) == 3


def test_the_session_index_is_bounded_and_ages_out() -> None:
    index = SessionIndex(capacity=2, ttl_s=10)
    index.record("a", "u1", now=0)
    index.record("b", "u2", now=1)
    assert index.get("a", now=5) == "u1"
    index.record("c", "u3", now=6)  # evicts the least recently used: b
    assert (index.get("b", now=6), index.get("c", now=6), len(index)) == (None, "u3", 2)
    assert index.get("a", now=10.5) is None  # older than the TTL
