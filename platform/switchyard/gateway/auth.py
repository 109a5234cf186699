"""API-key authentication: ``Authorization: Bearer <key>`` → tenant → tier.

Lookups are cached for ``key_cache_ttl_s`` (so a revocation takes effect within that time) and
misses for the same key share one database query. The cache is bounded so a flood of random
keys cannot grow it without limit; an expired entry stays in it until it is looked up again or
pushed out, because it is what a key falls back on while the database cannot be reached.

**The database unreachable.** A lookup that fails with a database error (connection refused,
dropped, timed out) falls back by the policy's ``resilience.dependencies.database``:

- ``fail_open``: a key with an (expired) cache entry keeps its cached answer, counted as
  ``switchyard_dependency_failures_total{dependency="database",mode="fail_open"}``; revocations
  wait for the database. A key never seen cannot be checked: 503 ``auth_unavailable``.
- ``fail_closed``: every key whose entry expired is refused: 503 ``auth_unavailable``.

A refusal carries ``Retry-After`` and is counted with ``mode="fail_closed"`` (what was done). After
a failure the database is left alone for a short back-off (one lookup then tries it again), so an
outage costs requests no connection attempts. Any other error of a lookup (a bug) is raised.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

import anyio.to_thread
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from switchyard.gateway.errors import Overloaded, Unauthorized
from switchyard.policy.resilience import FailureMode
from switchyard.store.keys import KeyIdentity, hash_key

log = logging.getLogger("switchyard.auth")

Lookup = Callable[[str], KeyIdentity | None]

#: Errors of a lookup that mean the database cannot answer now (not a bug).
DATABASE_ERRORS: tuple[type[BaseException], ...] = (DBAPIError, DisconnectionError, PoolTimeoutError, OSError)
#: After a failed lookup, seconds during which keys are answered from the cache without trying.
LOOKUP_BACKOFF_S = 1.0
#: ``Retry-After`` of a 503 ``auth_unavailable``.
RETRY_AFTER_S = 2
#: Least seconds between two warnings that keys are answered without the database.
WARN_EVERY_S = 30.0


class KeyAuthenticator:
    """Turns a presented key into a :class:`KeyIdentity`, or raises 401 (or 503: see the module doc).

    Args:
        lookup: The database lookup of a key's hash (blocking; run in a worker thread).
        ttl_s: How long a lookup's answer is trusted.
        max_entries: Most keys cached.
        counted: Called with ``fail_open`` or ``fail_closed`` for each key answered from an
            expired entry or refused because the database is unreachable.
        backoff_s: How long the database is left alone after a failed lookup.
        warn_every_s: Least seconds between two warnings about the fallback.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, lookup: Lookup, ttl_s: float, max_entries: int = 50_000,
                 counted: Callable[[FailureMode], None] = lambda _mode: None, *,
                 backoff_s: float = LOOKUP_BACKOFF_S, warn_every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._ttl = ttl_s
        self._max = max_entries
        self._counted = counted
        self._backoff_s = backoff_s
        self._warn_every_s = warn_every_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[KeyIdentity | None, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[KeyIdentity | None]] = {}
        self._down_since: float | None = None  # when lookups last started failing
        self._retry_at = 0.0  # lookups are skipped until then
        self._warned_at = -math.inf
        self._unwarned = 0
        self._error = ""

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

    @property
    def database_down(self) -> bool:
        """Whether a lookup failed and none has succeeded since."""
        return self._down_since is not None

    async def authenticate(self, header: str | None, database: FailureMode = "fail_open") -> KeyIdentity:
        """The identity behind the header's key.

        Args:
            header: The ``Authorization`` header's value.
            database: What to do when the database cannot be reached (the policy's
                ``resilience.dependencies.database``).

        Raises:
            Unauthorized: no key, a malformed header, or a key the database does not know (401).
            Overloaded: the key cannot be checked because the database is unreachable (503,
                code ``auth_unavailable``).
        """
        digest = hash_key(self.bearer(header))
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            identity = cached[0]
        elif self._down_since is not None and now < self._retry_at:
            identity = self._fallback(cached, database)
        else:
            if self._down_since is not None:
                self._retry_at = now + self._backoff_s  # this lookup tries; the others fall back meanwhile
            try:
                identity = await self._fetch(digest)
            except DATABASE_ERRORS as exc:
                self._failed(exc)
                identity = self._fallback(cached, database)
            else:
                self._answered()
        if identity is None:
            raise Unauthorized("Incorrect API key provided.")
        return identity

    def _failed(self, exc: BaseException) -> None:
        now = self._clock()
        self._retry_at = now + self._backoff_s
        self._error = f"{exc.__class__.__name__}: {exc}"[:300]
        if self._down_since is None:
            self._down_since = now
            self._warned_at = -math.inf  # the outage's first fallback is logged at once

    def _answered(self) -> None:
        if self._down_since is not None:
            log.warning("key lookups succeed again after %.1f s of database errors; %d requests since the last "
                        "warning were answered from the key cache or refused", self._clock() - self._down_since,
                        self._unwarned)
            self._down_since = None
            self._unwarned = 0

    def _fallback(self, cached: tuple[KeyIdentity | None, float] | None, mode: FailureMode) -> KeyIdentity | None:
        """The expired entry's answer (``fail_open``), else raise the 503; counted, warned now and then."""
        served = cached is not None and mode == "fail_open"
        self._counted("fail_open" if served else "fail_closed")
        self._unwarned += 1
        now = self._clock()
        if now - self._warned_at >= self._warn_every_s:
            log.warning("database unreachable for key lookups for %.1f s (%s): %s (policy "
                        "resilience.dependencies.database: %s); %d requests since the last warning",
                        now - (self._down_since or now), self._error,
                        "keys seen before answer from the cache, others get 503" if mode == "fail_open"
                        else "keys whose cache entry expired get 503", mode, self._unwarned)
            self._warned_at = now
            self._unwarned = 0
        if served:
            assert cached is not None
            return cached[0]
        raise Overloaded("API keys cannot be checked right now (the database is unreachable); please retry "
                         "shortly.", code="auth_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})

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
        self._cache[digest] = (identity, self._clock() + self._ttl)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return identity
