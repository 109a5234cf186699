"""The in-process response cache: one LRU per rule, for a gateway that runs as one process."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from switchyard.store.cache.model import (
    VECTORS_PER_CONTEXT,
    CacheEntry,
    CacheStats,
    EvictionReason,
    check_put,
    ranked,
    served_to,
    unit_vector,
)


@dataclass(frozen=True, slots=True)
class _Held:
    entry: CacheEntry
    expires: float


@dataclass(frozen=True, slots=True)
class _Vector:
    unit: tuple[float, ...]
    expires: float


@dataclass(slots=True)
class _Rule:
    """One rule's entries (least recently used first) and semantic vectors."""

    entries: OrderedDict[str, _Held] = field(default_factory=OrderedDict)
    #: (context, key), oldest first: bounds the rule's vectors to its ``max_entries``.
    order: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    #: context → key → vector, each context oldest first.
    contexts: dict[str, dict[str, _Vector]] = field(default_factory=dict)


class MemoryResponseCache:
    """Answers in ordered dicts; every operation runs to its end without awaiting, so the tasks of
    one event loop see each other's operations whole (not meant to be shared between threads).

    Expiry is checked when an entry is read (an expired entry is evicted then, reason ``ttl``) and
    at each put for the rule's least recently used entries; :meth:`stats` and :meth:`purge` sweep
    everything first. Vectors are scaled to unit length once, at insert, so a similarity is a dot
    product; a context keeps :data:`VECTORS_PER_CONTEXT`, a rule ``max_entries`` vectors in all.

    Args:
        clock: Seconds on a clock that never goes back (tests pass their own).
        vectors_per_context: The bound on one context's vectors.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 vectors_per_context: int = VECTORS_PER_CONTEXT) -> None:
        self._clock = clock
        self._per_context = vectors_per_context
        self._rules: dict[str, _Rule] = {}
        self._evictions: dict[str, int] = {"ttl": 0, "size": 0}

    async def get(self, rule: str, key: str, tenant: str | None) -> CacheEntry | None:
        """The live entry under ``key`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        held = self._live(rule, key, self._clock())
        if held is None or not served_to(held.entry, tenant):
            return None
        self._rules[rule].entries.move_to_end(key)
        return held.entry

    async def put(self, rule: str, key: str, entry: CacheEntry, ttl_s: float, max_entries: int) -> bool:
        """Store ``entry`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        if not check_put(ttl_s, max_entries):
            return False
        now = self._clock()
        state = self._rules.setdefault(rule, _Rule())
        state.entries.pop(key, None)
        state.entries[key] = _Held(entry, now + ttl_s)
        while len(state.entries) > 1:
            oldest, held = next(iter(state.entries.items()))
            if held.expires > now:
                break
            self._evict(state, oldest, "ttl")
        while len(state.entries) > max_entries:
            self._evict(state, next(iter(state.entries)), "size")
        return True

    async def nearest(self, rule: str, context: str, vector: Sequence[float], min_similarity: float,
                      tenant: str | None) -> tuple[CacheEntry, float] | None:
        """The closest live entry in ``context`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        query = unit_vector(vector)
        state = self._rules.get(rule)
        vectors = None if state is None else state.contexts.get(context)
        if query is None or state is None or vectors is None:
            return None
        now = self._clock()
        for key in [k for k, v in vectors.items() if v.expires <= now]:
            self._drop_vector(state, context, key)
        candidates = ranked(query, [(k, v.unit) for k, v in vectors.items()], min_similarity)
        for similarity, key in candidates:
            held = self._live(rule, key, now)
            if held is None:
                self._drop_vector(state, context, key)
            elif served_to(held.entry, tenant):
                state.entries.move_to_end(key)
                return held.entry, similarity
        return None

    async def put_vector(self, rule: str, context: str, key: str, vector: Sequence[float], ttl_s: float,
                         max_entries: int) -> None:
        """Remember ``vector`` for ``key`` (see :class:`~switchyard.store.cache.ResponseCache`)."""
        unit = unit_vector(vector)
        if unit is None or not check_put(ttl_s, max_entries):
            return
        state = self._rules.setdefault(rule, _Rule())
        self._drop_vector(state, context, key)
        vectors = state.contexts.setdefault(context, {})
        vectors[key] = _Vector(unit, self._clock() + ttl_s)
        state.order[(context, key)] = None
        while len(vectors) > min(self._per_context, max_entries):
            self._drop_vector(state, context, next(iter(vectors)))
        while len(state.order) > max_entries:
            self._drop_vector(state, *next(iter(state.order)))

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        """Remove matching live entries (see :class:`~switchyard.store.cache.ResponseCache`)."""
        self._sweep()
        removed = 0
        for state in self._rules.values():
            if tenant is None and model is None:
                removed += len(state.entries)
                state.entries.clear()
                state.order.clear()
                state.contexts.clear()
                continue
            gone = [k for k, held in state.entries.items()
                    if (tenant is None or held.entry.tenant == tenant) and (model is None or held.entry.model == model)]
            for key in gone:
                del state.entries[key]
            removed += len(gone)
        return removed

    async def stats(self) -> CacheStats:
        """Entries, bytes and evictions now."""
        self._sweep()
        entries = [held for state in self._rules.values() for held in state.entries.values()]
        return CacheStats(len(entries), sum(len(h.entry.body) for h in entries), dict(self._evictions))

    async def aclose(self) -> None:
        """Nothing to release: the entries live and die with the process."""

    def _live(self, rule: str, key: str, now: float) -> _Held | None:
        """The entry under ``key`` if it has not expired (an expired one is evicted)."""
        state = self._rules.get(rule)
        held = None if state is None else state.entries.get(key)
        if state is None or held is None:
            return None
        if held.expires <= now:
            self._evict(state, key, "ttl")
            return None
        return held

    def _evict(self, state: _Rule, key: str, reason: EvictionReason) -> None:
        del state.entries[key]
        self._evictions[reason] += 1

    def _sweep(self) -> None:
        now = self._clock()
        for state in self._rules.values():
            for key in [k for k, held in state.entries.items() if held.expires <= now]:
                self._evict(state, key, "ttl")

    @staticmethod
    def _drop_vector(state: _Rule, context: str, key: str) -> None:
        vectors = state.contexts.get(context)
        if vectors is None or vectors.pop(key, None) is None:
            return
        del state.order[(context, key)]
        if not vectors:
            del state.contexts[context]
