"""API-key authentication: ``Authorization: Bearer <key>`` → tenant → tier.

Lookups are cached (at most ``key_cache_ttl_s``), bounded so that a flood of random keys cannot grow
the cache without limit, and misses for the same key share one database query. An expired entry
stays until it is looked up again or pushed out: it is what a key falls back on while the database
cannot be reached.

**A change takes effect at the next request, in every process.** Revoking a key, deleting a tenant,
moving it to another tier or changing a region or a limit override is announced in the change's own
transaction (``store/key_changes.py`` has the protocol):

- *PostgreSQL*: each gateway process LISTENs (``gateway/reload.py``, the connection that also hears
  policy publishes) and drops the identities of a key or tenant as soon as its notification arrives,
  then acknowledges it; the call that made the change (admin API, console, CLI) waits until every
  listening process acknowledged (at most 2 s, then it logs a warning and says so). While its
  listening connection is down a process trusts no cached answer: every request is looked up, so a
  process that cannot hear a revocation cannot miss one either.
- *SQLite*: before answering from the cache a process checks the database's key-change marker
  (``PRAGMA user_version``, bumped in the change's transaction, and a stamp file beside the database
  moved right after its commit: the process compares the stamp in its memory map, and reads the
  marker, through a connection of its own with a 20 ms busy timeout, when the stamp moved or every
  quarter second; a busy database means a lookup instead). Every process on the file (``serve
  --workers N``, a CLI change while a gateway runs) therefore sees a change at its next request; a
  change through a gateway process also drops that process's entries at once.

So ``key_cache_ttl_s`` only bounds a change made behind Switchyard's back (SQL by hand) and a
PostgreSQL listener that died without its connection breaking (it is probed every few seconds). A
lookup that was in flight when entries were dropped answers its own request but is not cached.

**Constant time.** The presented key is hashed (SHA-256 of a fixed-length string takes the same time
whatever its bytes) and only the digest is compared: in this cache's dict and in the database's
unique index. Such comparisons stop at the first differing byte of the *digests*, so their timing
can tell at most how many leading bytes of a guess's digest a stored digest shares; that says nothing
about the 256-bit random key behind the stored digest (finding inputs whose digests share a chosen
prefix is a preimage search), so no guess gets an attacker closer to a key.

**The database unreachable.** A lookup that fails with a database error (connection refused,
dropped, timed out) falls back by the policy's ``resilience.dependencies.database``:

- ``fail_open``: a key with an (expired) cache entry keeps its cached answer, counted as
  ``switchyard_dependency_failures_total{dependency="database",mode="fail_open"}``; revocations
  wait for the database (a revocation a process heard of deletes the key's entries: they never fall
  back). A key never seen cannot be checked: 503 ``auth_unavailable``.
- ``fail_closed``: every key whose entry expired is refused: 503 ``auth_unavailable`` (on PostgreSQL,
  while the process cannot hear key changes, every entry counts as expired).

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
from collections.abc import Callable, Iterable

import anyio.to_thread
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from switchyard.api.errors import Overloaded, Unauthorized
from switchyard.policy.resilience import FailureMode
from switchyard.store.key_changes import parse_notice
from switchyard.store.keys import KeyIdentity, hash_key

log = logging.getLogger("switchyard.auth")

Lookup = Callable[[str], KeyIdentity | None]
#: Reads a database's key-change marker (raises when it cannot be read now).
Marker = Callable[[], int]

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
        needs_listener: Trust cached answers only while :meth:`listening` says key changes are heard
            (PostgreSQL: the LISTEN connection is up).
    """

    def __init__(self, lookup: Lookup, ttl_s: float, max_entries: int = 50_000,
                 counted: Callable[[FailureMode], None] = lambda _mode: None, *,
                 backoff_s: float = LOOKUP_BACKOFF_S, warn_every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, needs_listener: bool = False) -> None:
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
        self._needs_listener = needs_listener
        self._listening = False
        self._marker: Marker | None = None
        self._marker_seen = 0
        #: Bumped whenever entries are dropped: a lookup that started before is not cached.
        self._generation = 0

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
        if cached is not None and cached[1] > now and self._current():
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

    # --- key changes (see the module doc) --------------------------------------------------------

    def follow_marker(self, marker: Marker) -> None:
        """Check ``marker`` (a SQLite database's key-change marker) before every answer from the cache."""
        self._marker = marker
        self._marker_seen = marker()

    def listening(self, up: bool) -> None:
        """Whether key changes are heard now. Coming up expires every entry (changes made while not
        listening were missed); until then, and while down, cached answers are not trusted."""
        if up:
            self.expire_all()
        self._listening = up

    @property
    def trusts_cache(self) -> bool:
        """Whether cached answers are used now (else every request is looked up)."""
        return self._listening or not self._needs_listener

    def changes(self) -> int | None:
        """A number that moves whenever cached identities are dropped, checked as an answer from the
        cache is (listener up, marker read); None while no cached answer may be used. Another cache of
        identities (the batch worker's, by key id) keeps an entry only while this number stays what it
        was before the entry's lookup, and so follows every key change as this cache does."""
        return self._generation if self._current() else None

    def notice(self, payload: str) -> str | None:
        """Act on a ``switchyard_keys`` notification; the acknowledgement to send (None: none is due)."""
        try:
            ack, target = parse_notice(payload)
        except ValueError:
            log.warning("ignoring a malformed key change notice %r; expiring every cached key instead", payload[:100])
            self.expire_all()
            return None
        self.forget((target,))
        return ack

    def forget(self, targets: Iterable[str]) -> int:
        """Drop the entries of ``key:<id>`` and ``tenant:<id>`` targets (anything else expires every entry);
        how many were dropped."""
        keys: set[int] = set()
        tenants: set[int] = set()
        for target in targets:
            kind, _, number = target.partition(":")
            if kind == "key" and number.isdigit():
                keys.add(int(number))
            elif kind == "tenant" and number.isdigit():
                tenants.add(int(number))
            else:
                self.expire_all()
        self._dropped()
        doomed = [digest for digest, (identity, _at) in self._cache.items()
                  if identity is not None and (identity.key_id in keys or identity.tenant_id in tenants)]
        for digest in doomed:
            del self._cache[digest]
        return len(doomed)

    def expire_all(self) -> None:
        """Stop trusting every entry (each stays as a fallback while the database is unreachable)."""
        self._dropped()
        for digest, (identity, _at) in self._cache.items():
            self._cache[digest] = (identity, -math.inf)

    def _dropped(self) -> None:
        self._generation += 1
        self._pending.clear()  # requests from now on do not join lookups that started before

    def _current(self) -> bool:
        """Whether the cache may answer now: listening when that is needed, and the marker unchanged
        (a changed marker expires every entry first)."""
        if self._needs_listener and not self._listening:
            return False
        if self._marker is None:
            return True
        try:
            seen = self._marker()
        except Exception as exc:  # busy or unreadable: look the key up instead
            log.debug("key-change marker unreadable (%s); looking the key up", exc)
            return False
        if seen != self._marker_seen:
            self._marker_seen = seen
            self.expire_all()
            return False
        return True

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
        generation = self._generation
        try:
            identity = await anyio.to_thread.run_sync(self._lookup, digest)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            if self._pending.get(digest) is future:
                del self._pending[digest]
        future.set_result(identity)
        if generation != self._generation:
            return identity  # entries were dropped meanwhile: this answer may predate the change
        self._cache[digest] = (identity, self._clock() + self._ttl)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return identity
