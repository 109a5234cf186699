"""Session affinity: which endpoint served a conversation last, so the next turn can go there too.

The session is named by a request header (``x-session-id`` unless the profile says otherwise) or,
where the profile allows, the body's ``user`` field; it is kept per tenant and model. The index is
bounded (least recently used entries go first) and entries age out after a TTL, so a session that
went quiet does not pin its replica forever.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from switchyard.decide.plugins import Profile

#: Session ids longer than this are cut: the key is memory the client controls.
MAX_SESSION_CHARS = 256


def session_key(profile: Profile, headers: Mapping[str, str], body: Mapping[str, Any], tenant: str,
                model: str) -> str | None:
    """The request's session under ``profile`` (None: the profile has no session affinity, or no id was given)."""
    spec = profile.session
    if spec is None:
        return None
    header, use_user = spec
    sid = headers.get(header)
    if not sid and use_user:
        user = body.get("user")
        sid = user if isinstance(user, str) else None
    if not sid:
        return None
    return f"{tenant}\x00{model}\x00{sid[:MAX_SESSION_CHARS]}"


class SessionIndex:
    """Session key → the endpoint that served it last; bounded in entries and age."""

    __slots__ = ("_entries", "capacity", "ttl_s")

    def __init__(self, capacity: int = 100_000, ttl_s: float = 1800.0) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.capacity = capacity
        self.ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float | None = None) -> str | None:
        """The endpoint of session ``key``, unless it is unknown or older than the TTL."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        if now - entry[1] > self.ttl_s:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def record(self, key: str, url: str, now: float | None = None) -> None:
        """Remember that ``url`` served session ``key``."""
        entries = self._entries
        entries[key] = (url, time.monotonic() if now is None else now)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
