"""Prefix hashing and its index, prompt rendering and fallback plans as pure functions."""

from __future__ import annotations

import pytest

from switchyard.decide.pick import fallback_plan
from switchyard.decide.prefix import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml

U1, U2, U3 = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return compile_policy(to_yaml(base()))


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS
    b = "c" * BLOCK_CHARS + "b" * BLOCK_CHARS
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 2 and ha[1] != hb[1]
    assert block_hashes(a + "x" * (BLOCK_CHARS - 1)) == ha  # a partial block is not hashed
    assert block_hashes(a + "tail" * BLOCK_CHARS)[:2] == ha
    assert block_hashes("short") == []
    assert len(block_hashes("z" * BLOCK_CHARS * 10, max_blocks=4)) == 4


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


def test_prompt_text_renders_chat_and_completions() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert prompt_text(chat) == "<system>be brief\n<user>hello\n"
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "hi"}]}
    assert prompt_text(longer).startswith(prompt_text(chat))
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 22, 333]}) == "001,022,333"
    assert prompt_text({"messages": [{"role": "user", "content": "x" * 100}]}, limit=10) == "<user>xxxx"


def test_fallback_plan_follows_the_chain(snapshot: PolicySnapshot) -> None:
    small = fallback_plan(snapshot, snapshot.models["small"])
    assert [(s.label, [p.name for p in s.pools]) for s in small] == [
        ("small", ["small-us", "small-eu"]), ("small@eu-west", ["small-eu"])]
    large = fallback_plan(snapshot, snapshot.models["large"])
    assert [(s.label, s.model.name) for s in large] == [("large", "large"), ("small", "small")]
    assert [c.url for c in large[1].candidates()] == [U1, U2, U3]
    # Pools outside the tier's regions are out of every stage; an emptied fallback stage is dropped.
    eu = fallback_plan(snapshot, snapshot.models["small"], frozenset({"eu-west"}))
    assert [(s.label, [p.name for p in s.pools]) for s in eu] == [("small", ["small-eu"]),
                                                                ("small@eu-west", ["small-eu"])]
    us = fallback_plan(snapshot, snapshot.models["small"], frozenset({"us-east"}))
    assert [(s.label, [p.name for p in s.pools]) for s in us] == [("small", ["small-us"])]
    assert fallback_plan(snapshot, snapshot.models["large"], frozenset({"eu-west"}))[0].pools == ()
