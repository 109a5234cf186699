"""What the response caches keep and tell, the interface both backends implement, and vector arithmetic."""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

#: Why an entry left the cache before anyone purged it: its time ran out, or its rule was full.
EvictionReason = Literal["ttl", "size"]

#: Most vectors one (rule, context) keeps; the oldest go first. A lookup compares the query with
#: every vector of its context, so this bounds its cost (and, on Redis, what one lookup fetches).
VECTORS_PER_CONTEXT = 256

#: Slack for float32 storage: a vector compared with itself may come out a hair below 1.
SIMILARITY_EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A cached answer.

    Attributes:
        body: A complete, non-streamed OpenAI JSON answer.
        model: The resolved model that gave it.
        tenant: The tenant that owns it (tenant-scoped rules), None for a global rule.
        rule: The label of the rule it was stored under.
        created: When it was stored (unix time).
        prompt_tokens, completion_tokens: The usage of the request that produced it.
    """

    body: bytes
    model: str
    tenant: str | None
    rule: str
    created: float
    prompt_tokens: int
    completion_tokens: int

    def encode(self) -> bytes:
        """The entry as bytes (MessagePack)."""
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> CacheEntry:
        """The entry that :meth:`encode` turned into ``data``.

        Raises:
            msgspec.DecodeError: ``data`` is not an encoded entry.
        """
        return msgspec.msgpack.decode(data, type=CacheEntry)


def _no_evictions() -> dict[str, int]:
    return {"ttl": 0, "size": 0}


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What a cache holds now, and how many entries it has evicted since it started.

    Attributes:
        entries: Live entries (expired ones are swept before counting).
        bytes: The sum of their answers' sizes (``len(body)``).
        evictions: Entries evicted by reason: ``ttl`` (expired) and ``size`` (rule full, least
            recently used first). Purged entries are not evictions.
    """

    entries: int
    bytes: int
    evictions: dict[str, int] = field(default_factory=_no_evictions)


def served_to(entry: CacheEntry, tenant: str | None) -> bool:
    """Whether ``entry`` may be served to ``tenant``: global entries to all, others to their owner."""
    return entry.tenant is None or entry.tenant == tenant


def check_put(ttl_s: float, max_entries: int) -> bool:
    """Whether a put with these bounds can store anything (a finite ttl > 0, room for one entry)."""
    return math.isfinite(ttl_s) and ttl_s > 0 and max_entries >= 1


def unit_vector(vector: Sequence[float]) -> tuple[float, ...] | None:
    """``vector`` scaled to length 1, or None when it has none (empty, zero, not finite)."""
    values = tuple(float(x) for x in vector)
    norm = math.sqrt(sum(x * x for x in values))
    if not values or not math.isfinite(norm) or norm == 0.0:
        return None
    return tuple(x / norm for x in values)


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The dot product of two vectors of one length (cosine similarity, for unit vectors)."""
    return float(sum(map(operator.mul, a, b)))


def pack_vector(vector: Sequence[float]) -> bytes:
    """A vector as little-endian float32."""
    return struct.pack(f"<{len(vector)}f", *vector)


def unpack_vector(data: bytes) -> tuple[float, ...]:
    """The vector :func:`pack_vector` packed (a partial trailing float is ignored)."""
    return struct.unpack(f"<{len(data) // 4}f", data[: len(data) // 4 * 4])


def ranked(query: Sequence[float], vectors: Sequence[tuple[str, Sequence[float]]],
           min_similarity: float) -> list[tuple[float, str]]:
    """``(similarity, key)`` of the vectors at least ``min_similarity`` like the unit ``query``, best
    first (ties by key); vectors of another dimension are skipped."""
    floor = min_similarity - SIMILARITY_EPSILON
    hits = []
    for key, vector in vectors:
        if len(vector) == len(query):
            similarity = dot(query, vector)
            if similarity >= floor:
                hits.append((min(similarity, 1.0), key))
    hits.sort(key=lambda hit: (-hit[0], hit[1]))
    return hits


class ResponseCache(Protocol):
    """Cached answers by rule and key, and semantic vectors by rule and context.

    Entries live ``ttl_s`` from their put (never refreshed by use); a rule keeps at most
    ``max_entries`` of them, evicting the least recently used (a get or nearest hit is a use).
    Errors of a shared backend (Redis down) propagate: the caller treats them as a miss.
    """

    async def get(self, rule: str, key: str, tenant: str | None) -> CacheEntry | None:
        """The live entry under ``key``, or None; never one owned by a tenant other than ``tenant``."""
        ...

    async def put(self, rule: str, key: str, entry: CacheEntry, ttl_s: float, max_entries: int) -> bool:
        """Store ``entry`` under ``key`` (replacing one there) for ``ttl_s`` seconds, evicting the rule's
        least recently used entries beyond ``max_entries``. False when not stored (no ttl or room)."""
        ...

    async def nearest(self, rule: str, context: str, vector: Sequence[float], min_similarity: float,
                      tenant: str | None) -> tuple[CacheEntry, float] | None:
        """The live entry whose vector, among those put under (``rule``, ``context``), is most like
        ``vector`` (cosine similarity at least ``min_similarity``), with that similarity; None when
        there is none. Entries that expired or were evicted or purged are never returned, nor entries
        another tenant owns."""
        ...

    async def put_vector(self, rule: str, context: str, key: str, vector: Sequence[float], ttl_s: float,
                         max_entries: int) -> None:
        """Remember ``vector`` for the entry under ``key`` (stored with :meth:`put`) in ``context``; a
        context keeps at most :data:`VECTORS_PER_CONTEXT` (and ``max_entries``), the oldest go first.
        A vector with no direction (zero, empty) is ignored."""
        ...

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        """Remove the live entries owned by ``tenant`` and answered by ``model`` (None: any; both None:
        everything); returns how many."""
        ...

    async def stats(self) -> CacheStats:
        """Entries, bytes and evictions now (deployment-wide on a shared backend)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
