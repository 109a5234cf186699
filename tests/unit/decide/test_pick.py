"""Prefix hashing, prompt rendering and fallback plans as pure functions."""

from __future__ import annotations

import pytest

from switchyard.decide.pick import fallback_plan
from switchyard.decide.prefix import BLOCK_CHARS, block_hashes, prompt_text
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
