"""The index of an engine's prefix cache built from its KV-cache events (state/kvindex.py)."""

from __future__ import annotations

from switchyard.kvcache.blocks import ROOT, chain_key, chain_keys
from switchyard.kvcache.wire import AllBlocksCleared, BlockRemoved, BlockStored
from switchyard.state.kvindex import BlockSet, EngineCache, EngineCaches

BS = 4
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None}
    fields.update(kw)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       **fields)  # type: ignore[arg-type]


def live(*events: object) -> EngineCaches:
    caches = EngineCaches()
    cache = EngineCache("http://e1")
    cache.synced = True
    cache.connected = True
    caches.add(cache)
    cache.apply(0, list(events), now=0.0)  # type: ignore[arg-type]
    return caches


def test_blocks_are_named_by_the_chain_of_their_tokens_whatever_the_engine_hashes() -> None:
    a, b = BlockSet(), BlockSet()
    a.apply(stored([11, 12], None, PROMPT[:8]))
    a.apply(stored([13], 12, PROMPT[8:12]))
    b.apply(stored([901], None, PROMPT[:4]))  # another engine, other hashes, same tokens in other batches
    b.apply(stored([902, 903], 901, PROMPT[4:12]))
    assert a.keys() == b.keys() == set(chain_keys(PROMPT, BS, limit=3))
    assert a.leading(chain_keys(PROMPT, BS)) == 3
    assert chain_keys(PROMPT, BS)[1] == chain_key(chain_key(ROOT, PROMPT[:4]), PROMPT[4:8])


def test_held_counts_the_leading_run_in_tokens_and_a_removed_block_breaks_it() -> None:
    caches = live(stored([1, 2, 3, 4], None, PROMPT[:16]))
    assert caches.held("http://e1", PROMPT, 0.0) == 16
    assert caches.held("http://e1", PROMPT[:8] + [0] * 10, 0.0) == 8  # diverges in the third block
    cache = caches.get("http://e1")
    assert cache is not None
    cache.apply(1, [BlockRemoved(block_hashes=[2], medium="GPU")], 0.0)
    assert caches.held("http://e1", PROMPT, 0.0) == 4
    cache.apply(2, [AllBlocksCleared()], 0.0)
    assert caches.held("http://e1", PROMPT, 0.0) == 0
    assert len(cache.blocks) == 0


def test_a_block_whose_parent_was_never_seen_cannot_be_named() -> None:
    blocks = BlockSet()
    blocks.apply(stored([7], 6, PROMPT[4:8]))
    assert len(blocks) == 0 and blocks.orphans == 1


def test_offloaded_and_adapter_blocks_do_not_count_and_a_repeated_store_counts_once() -> None:
    blocks = BlockSet()
    blocks.apply(stored([1], None, PROMPT[:4], medium="CPU"))
    blocks.apply(stored([2], None, PROMPT[:4], lora_name="adapter", lora_id=3))
    blocks.apply(stored([3], None, PROMPT[:4], extra_keys=[("salt-of-tenant-a",)]))  # a cache_salt
    blocks.apply(stored([4], 3, PROMPT[4:8], extra_keys=[None]))  # its child cannot be named either
    assert len(blocks) == 0 and blocks.orphans == 1
    blocks.apply(stored([1], None, PROMPT[:4]))
    blocks.apply(stored([1], None, PROMPT[:4]))  # vLLM may report a reused block again
    blocks.apply(BlockRemoved(block_hashes=[1], medium="GPU"))
    assert len(blocks) == 0 and not blocks.keys()


def test_an_engine_not_in_step_is_not_known_never_what_it_held_before() -> None:
    caches = live(stored([1, 2], None, PROMPT[:8]))
    cache = caches.get("http://e1")
    assert cache is not None
    assert caches.held("http://e2", PROMPT, 0.0) is None  # no events from it
    cache.reset("engine restarted")
    assert caches.held("http://e1", PROMPT, 0.0) is None
    assert len(cache.blocks) == 0 and cache.state(0.0) == "syncing"


def test_a_stream_silent_after_a_request_that_must_store_blocks_goes_stale() -> None:
    caches = live(stored([1], None, PROMPT[:4]))
    cache = caches.get("http://e1")
    assert cache is not None
    cache.stale_after_s = 5.0
    caches.expect("http://e1", PROMPT[:6], held=4, now=10.0)  # 2 new tokens: no full block to store
    assert cache.expecting_since is None
    caches.expect("http://e1", PROMPT, held=4, now=10.0)
    assert caches.held("http://e1", PROMPT, 14.0) == 4
    assert caches.held("http://e1", PROMPT, 15.5) is None and cache.state(15.5) == "stale"
    cache.apply(1, [stored([2], 1, PROMPT[4:8])], now=16.0)
    assert caches.held("http://e1", PROMPT, 16.0) == 8 and cache.state(16.0) == "live"
