"""Endpoint picking, prefix affinity and fallback plans as pure functions."""

from __future__ import annotations

import pytest

from switchyard.decide.pick import HERD_MARGIN, EndpointView, candidates, fallback_plan, pick_endpoint
from switchyard.decide.prefix import BLOCK_CHARS, PrefixIndex, block_hashes, prompt_text
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml

U1, U2, U3 = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return compile_policy(to_yaml(base()))


def views(**by_port: EndpointView) -> dict[str, EndpointView]:
    return {f"http://127.0.0.1:{port[1:]}": v for port, v in by_port.items()}


def test_ties_go_round_robin_and_the_least_loaded_wins(snapshot: PolicySnapshot) -> None:
    options = candidates(snapshot, snapshot.models["small"])
    assert [o.url for o in options] == [U1, U2, U3]
    loads = {U1: EndpointView(load=3), U2: EndpointView(load=1), U3: EndpointView(load=1)}
    picked = {pick_endpoint(options, loads.__getitem__, {}, r).url for r in range(6)}  # type: ignore[union-attr]
    assert picked == {U2, U3}
    idle = {pick_endpoint(options, lambda u: EndpointView(), {}, r).url for r in range(3)}  # type: ignore[union-attr]
    assert idle == {U1, U2, U3}


def test_endpoints_in_cool_down_and_tried_ones_are_left_out(snapshot: PolicySnapshot) -> None:
    options = candidates(snapshot, snapshot.models["small"])
    state = {U1: EndpointView(healthy=False), U2: EndpointView(load=9), U3: EndpointView(healthy=False)}
    choice = pick_endpoint(options, state.__getitem__, {U1: 1.0}, 0)
    assert choice is not None and choice.url == U2
    assert "2 in cool-down" in choice.trace
    # A stage with a healthy endpoint never falls back on its cooling ones...
    assert pick_endpoint(options, state.__getitem__, {}, 0, exclude={U2}) is None
    # ...but when every endpoint is cooling down, one is tried anyway rather than refusing.
    down = {u: EndpointView(healthy=False) for u in (U1, U2, U3)}
    choice = pick_endpoint(options, down.__getitem__, {}, 0, exclude={U2})
    assert choice is not None and choice.url in (U1, U3)
    assert "every endpoint in cool-down" in choice.trace
    assert pick_endpoint(options, down.__getitem__, {}, 0, exclude={U1, U2, U3}) is None
    assert pick_endpoint([], state.__getitem__, {}, 0) is None


def test_prefix_affinity_wins_at_equal_load_and_over_small_imbalances(snapshot: PolicySnapshot) -> None:
    options = candidates(snapshot, snapshot.models["small"])
    for r in range(3):
        idle = pick_endpoint(options, lambda u: EndpointView(), {U3: 1.0}, r)
        assert idle is not None and idle.url == U3 and idle.affinity == 1.0
    slightly_busier = {U1: EndpointView(load=0), U2: EndpointView(load=0), U3: EndpointView(load=HERD_MARGIN)}
    choice = pick_endpoint(options, slightly_busier.__getitem__, {U3: 1.0}, 0)
    assert choice is not None and choice.url == U3


def test_affinity_yields_when_the_affine_endpoint_is_saturated(snapshot: PolicySnapshot) -> None:
    """The herding guard: a queue inside the engine, or a load well above the least loaded."""
    options = candidates(snapshot, snapshot.models["small"])
    queued = {U1: EndpointView(), U2: EndpointView(), U3: EndpointView(load=1, queued=1)}
    choice = pick_endpoint(options, queued.__getitem__, {U3: 1.0}, 0)
    assert choice is not None and choice.url != U3 and choice.affinity == 0.0
    piled = {U1: EndpointView(), U2: EndpointView(), U3: EndpointView(load=HERD_MARGIN + 1)}
    choice = pick_endpoint(options, piled.__getitem__, {U3: 1.0}, 0)
    assert choice is not None and choice.url != U3


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


def test_baseline_strategies(snapshot: PolicySnapshot) -> None:
    options = candidates(snapshot, snapshot.models["small"])
    loads = {U1: EndpointView(load=5), U2: EndpointView(load=0), U3: EndpointView(load=1)}
    least = {pick_endpoint(options, loads.__getitem__, {U1: 1.0}, r, strategy="least-loaded").url  # type: ignore[union-attr]
             for r in range(3)}
    assert least == {U2}
    robin = [pick_endpoint(options, loads.__getitem__, {U1: 1.0}, r, strategy="round-robin").url  # type: ignore[union-attr]
             for r in range(3)]
    assert robin == [U1, U2, U3]
    down = {**loads, U2: EndpointView(healthy=False)}
    assert {pick_endpoint(options, down.__getitem__, {}, r, strategy="round-robin").url  # type: ignore[union-attr]
            for r in range(4)} == {U1, U3}
