"""The session index: which endpoint served a conversation last (session affinity's memory).

Bounded (least recently used entries go first) and aged (a session quiet for longer than the TTL
no longer pins its replica). Owned by an executor; the session-affinity scorer reads and records it
through :class:`switchyard.decide.views.SessionMemory`.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionIndex:
    """Session key → the endpoint that served it last; bounded in entries and age."""

    __slots__ = ("_entries", "capacity", "ttl_s")

    def __init__(self, capacity: int = 100_000, ttl_s: float = 1800.0) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.capacity = capacity
        self.ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> str | None:
        """The endpoint of session ``key`` at ``now``, unless it is unknown or older than the TTL."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def record(self, key: str, url: str, now: float) -> None:
        """Remember that ``url`` served session ``key`` at ``now``."""
        entries = self._entries
        entries[key] = (url, now)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
