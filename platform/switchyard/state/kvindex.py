"""What each engine's prefix cache holds, as its KV-cache events say: the precise scorer's truth.

One :class:`EngineCache` per endpoint, fed by the gateway's subscriber to that engine's events
(:mod:`switchyard.gateway.kvevents`), in sequence order. It translates the engine's block hashes into chain
keys of token blocks (:mod:`switchyard.kvcache.blocks`), so that a request's prompt, cut into the same keys,
can be looked up, and so that two gateway processes fed the same stream hold equal indexes.

An endpoint's cache is *known* only while its stream is in sequence: before the first sync, after a gap
until the replay filled it, after the engine restarted (its sequence numbers went back) until the new
stream was read from its start, and while requests that must have stored blocks there have had no event
for ``stale_after_s`` (the engine stopped publishing). While not known, :meth:`EngineCaches.held` answers
None and the scorer falls back to the approximate index; it never answers with what the engine held before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from switchyard.kvcache.blocks import ROOT, chain_key, iter_keys
from switchyard.kvcache.wire import MEDIUM_GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

#: Seconds a request that must store a block may go without any event before the stream counts as stale.
STALE_AFTER_S = 10.0


class BlockSet:
    """One engine's cached blocks: its hashes, each with the chain key of the prefix it ends.

    Only blocks in the engine's own memory count (``medium`` GPU or unset), of the base model (a request to
    a LoRA adapter never shares blocks with it), without extra keys (a ``cache_salt``, media: blocks no
    plain prompt can share). A stored block whose parent is unknown (its parent's event was never seen,
    or was one of those) cannot be named and is counted in :attr:`orphans`.
    """

    __slots__ = ("_by_hash", "_holders", "block_size", "orphans")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, bytes] = {}
        #: Chain key → how many of the engine's hashes name it (two hashes can: other extra keys, a salt).
        self._holders: dict[bytes, int] = {}
        self.block_size: int | None = None
        self.orphans = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, key: bytes) -> bool:
        return key in self._holders

    def keys(self) -> frozenset[bytes]:
        """The chain keys held (two indexes of one stream compare equal by these)."""
        return frozenset(self._holders)

    def clear(self) -> None:
        """Forget every block (the engine reset its cache, or restarted)."""
        self._by_hash.clear()
        self._holders.clear()

    def apply(self, event: Event) -> None:
        """Apply one event."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            if event.medium in (None, MEDIUM_GPU):
                for h in event.block_hashes:
                    self._drop(h)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in (None, MEDIUM_GPU) or event.lora_name is not None or event.lora_id is not None:
            return
        if event.extra_keys and any(keys for keys in event.extra_keys):
            return
        size = event.block_size
        if size <= 0 or len(event.token_ids) < size * len(event.block_hashes):
            self.orphans += len(event.block_hashes)
            return
        self.block_size = size
        parent_hash = event.parent_block_hash
        parent = ROOT if parent_hash is None else self._by_hash.get(parent_hash)
        if parent is None:
            self.orphans += len(event.block_hashes)
            return
        tokens = event.token_ids
        by_hash, holders = self._by_hash, self._holders
        for i, h in enumerate(event.block_hashes):
            key = chain_key(parent, tokens[i * size:(i + 1) * size])
            previous = by_hash.get(h)
            if previous != key:
                if previous is not None:
                    self._drop(h)
                by_hash[h] = key
                holders[key] = holders.get(key, 0) + 1
            parent = key

    def _drop(self, h: BlockHash) -> None:
        key = self._by_hash.pop(h, None)
        if key is None:
            return
        left = self._holders[key] - 1
        if left:
            self._holders[key] = left
        else:
            del self._holders[key]

    def leading(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are held without a break."""
        n = 0
        holders = self._holders
        for key in keys:
            if key not in holders:
                break
            n += 1
        return n


@dataclass(slots=True)
class EngineCache:
    """One endpoint's cache and the state of its event stream.

    Attributes:
        url: The endpoint (its HTTP base URL).
        events_url: Where its events are published (``tcp://host:port``).
        blocks: The blocks it holds, as far as its stream has been read.
        synced: Its stream has been read in sequence from a point the engine's state is known at.
        connected: The subscriber's socket is up (ZeroMQ reconnects on its own).
        last_seq: The last batch applied (None: none yet).
        batches: Batches applied.
        events: Events applied.
        gaps: Sequence gaps seen.
        gaps_recovered: Gaps filled from the replay socket.
        restarts: Times the engine's sequence went back (it restarted): the index was cleared.
        last_event_at: Clock time of the last batch applied.
        expecting_since: Clock time of the first request since then that must have stored blocks there.
        reason: Why it is not known, for the console (empty when known).
    """

    url: str
    events_url: str = ""
    blocks: BlockSet = field(default_factory=BlockSet)
    synced: bool = False
    connected: bool = False
    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    gaps_recovered: int = 0
    restarts: int = 0
    last_event_at: float | None = None
    expecting_since: float | None = None
    reason: str = "not yet synced"
    stale_after_s: float = STALE_AFTER_S

    def apply(self, seq: int, events: Sequence[Event], now: float) -> None:
        """Apply batch ``seq`` (the caller keeps the order: the next expected, or the first after a resync)."""
        blocks = self.blocks
        for event in events:
            blocks.apply(event)
        self.last_seq = seq
        self.batches += 1
        self.events += len(events)
        self.last_event_at = now
        self.expecting_since = None

    def reset(self, reason: str) -> None:
        """Forget everything known: the engine restarted, or its state cannot be recovered."""
        self.blocks.clear()
        self.synced = False
        self.last_seq = None
        self.expecting_since = None
        self.reason = reason

    def stale(self, now: float) -> bool:
        """Requests that must have stored blocks here went without an event for ``stale_after_s``."""
        since = self.expecting_since
        return since is not None and now - since > self.stale_after_s

    def known(self, now: float) -> bool:
        """Its events can be routed on now."""
        return self.synced and not self.stale(now)

    def state(self, now: float) -> str:
        """``live``, ``stale``, ``syncing`` or ``disconnected``, for the console and the metrics."""
        if not self.connected:
            return "disconnected"
        if not self.synced:
            return "syncing"
        return "stale" if self.stale(now) else "live"


class _Keys:
    """The chain keys of one prompt at one block size, made as far as a lookup has needed them (the scorer
    looks the same prompt up at every candidate: each key is hashed once)."""

    __slots__ = ("_made", "_source", "tokens")

    def __init__(self, tokens: Sequence[int], size: int) -> None:
        self.tokens = tokens
        self._source = iter_keys(tokens, size)
        self._made: list[bytes] = []

    def leading(self, blocks: BlockSet) -> int:
        """How many of the keys, from the first, ``blocks`` holds without a break."""
        made, n = self._made, 0
        while True:
            if n == len(made):
                key = next(self._source, None)
                if key is None:
                    return n
                made.append(key)
            if made[n] not in blocks:
                return n
            n += 1


class EngineCaches:
    """The caches of every endpoint with events: the :class:`~switchyard.decide.views.EngineCacheView`
    the precise scorer reads (an executor's truth about its engines)."""

    def __init__(self) -> None:
        self._caches: dict[str, EngineCache] = {}
        #: The last prompt looked up, by block size (the candidates of one pick share it).
        self._keys: dict[int, _Keys] = {}

    def __iter__(self) -> Iterator[EngineCache]:
        return iter(self._caches.values())

    def __len__(self) -> int:
        return len(self._caches)

    def get(self, url: str) -> EngineCache | None:
        """The cache of ``url`` (None: it publishes no events, or none are subscribed to)."""
        return self._caches.get(url)

    def add(self, cache: EngineCache) -> None:
        """Track ``cache`` (replacing one of the same endpoint)."""
        self._caches[cache.url] = cache

    def remove(self, url: str) -> None:
        """Stop tracking ``url``."""
        self._caches.pop(url, None)

    def knows(self, url: str, now: float) -> bool:
        """Whether the engine at ``url`` is known now (its stream in step and not stale)."""
        cache = self._caches.get(url)
        return cache is not None and cache.known(now)

    def held(self, url: str, tokens: Sequence[int], now: float) -> int | None:
        """Tokens of ``tokens``' longest prefix the engine at ``url`` holds now (None: not known)."""
        cache = self._caches.get(url)
        if cache is None or not cache.known(now):
            return None
        size = cache.blocks.block_size
        if size is None:  # a synced engine that stored nothing yet holds nothing
            return 0
        keys = self._keys.get(size)
        if keys is None or keys.tokens is not tokens:
            keys = self._keys[size] = _Keys(tokens, size)
        return keys.leading(cache.blocks) * size

    def expect(self, url: str, tokens: Sequence[int], held: int, now: float) -> None:
        """A request with ``tokens`` was sent to ``url``, which held ``held`` of them: when that leaves a full
        block to compute, the engine must publish; its stream is stale if it does not in time."""
        cache = self._caches.get(url)
        if cache is None or cache.expecting_since is not None:
            return
        size = cache.blocks.block_size
        if size is not None and len(tokens) - held >= size:
            cache.expecting_since = now
