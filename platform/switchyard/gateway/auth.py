"""API-key authentication: ``Authorization: Bearer <key>`` → tenant → tier.

Lookups are cached for ``key_cache_ttl_s`` (so a revocation takes effect within that time) and
misses for the same key share one database query. The cache is bounded so a flood of random
keys cannot grow it without limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

import anyio.to_thread

from switchyard.gateway.errors import Unauthorized
from switchyard.store.keys import KeyIdentity, hash_key

Lookup = Callable[[str], KeyIdentity | None]


class KeyAuthenticator:
    """Turns a presented key into a :class:`KeyIdentity`, or raises 401."""

    def __init__(self, lookup: Lookup, ttl_s: float, max_entries: int = 50_000) -> None:
        self._lookup = lookup
        self._ttl = ttl_s
        self._max = max_entries
        self._cache: OrderedDict[str, tuple[KeyIdentity | None, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[KeyIdentity | None]] = {}

    @staticmethod
    def bearer(header: str | None) -> str:
        """The key in an ``Authorization`` header value."""
        if not header:
            raise Unauthorized("You didn't provide an API key. Send it in the Authorization header "
                               "as 'Authorization: Bearer <key>'.")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("Malformed Authorization header; expected 'Bearer <key>'.")
        return key

    async def authenticate(self, header: str | None) -> KeyIdentity:
        """The identity behind the header's key."""
        digest = hash_key(self.bearer(header))
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            identity = cached[0]
        else:
            identity = await self._fetch(digest)
        if identity is None:
            raise Unauthorized("Incorrect API key provided.")
        return identity

    async def _fetch(self, digest: str) -> KeyIdentity | None:
        pending = self._pending.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[KeyIdentity | None] = asyncio.get_running_loop().create_future()
        self._pending[digest] = future
        try:
            identity = await anyio.to_thread.run_sync(self._lookup, digest)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._pending.pop(digest, None)
        future.set_result(identity)
        self._cache[digest] = (identity, time.monotonic() + self._ttl)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return identity
