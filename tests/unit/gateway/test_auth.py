"""Key authentication: parsing, caching, one lookup per key at a time, bounded memory, the database
unreachable (fail_open: keys seen before keep working; fail_closed: 503 once their entry expired), and key
changes (dropped entries, the PostgreSQL listener's state, the SQLite marker)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from switchyard.api.errors import Overloaded, Unauthorized
from switchyard.gateway.auth import KeyAuthenticator
from switchyard.store.keys import KEY_PREFIX, KeyIdentity, generate_key, hash_key

GOOD = generate_key()
WHO = KeyIdentity(key_id=1, tenant_id=1, tenant="acme", tier="pro")


class CountingLookup:
    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, digest: str) -> KeyIdentity | None:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay)
        return WHO if digest == hash_key(GOOD) else None


def test_generated_keys_are_random_and_prefixed() -> None:
    keys = {generate_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith(KEY_PREFIX) and len(k) == len(KEY_PREFIX) + 43 for k in keys)
    assert hash_key(GOOD) == hash_key(GOOD) and len(hash_key(GOOD)) == 64


@pytest.mark.parametrize(("header", "message"), [
    (None, "You didn't provide an API key"),
    ("", "You didn't provide an API key"),
    ("Basic abc", "Malformed Authorization header"),
    ("Bearer ", "Malformed Authorization header"),
])
async def test_missing_or_malformed_header(header: str | None, message: str) -> None:
    auth = KeyAuthenticator(CountingLookup(), ttl_s=10)
    with pytest.raises(Unauthorized, match=message):
        await auth.authenticate(header)


async def test_valid_key_is_cached_and_bad_key_refused() -> None:
    lookup = CountingLookup()
    auth = KeyAuthenticator(lookup, ttl_s=10)
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO
    assert await auth.authenticate(f"bearer {GOOD}") == WHO
    assert lookup.calls == 1
    with pytest.raises(Unauthorized, match="Incorrect API key"):
        await auth.authenticate("Bearer sk-sy-nope")
    with pytest.raises(Unauthorized):
        await auth.authenticate("Bearer sk-sy-nope")
    assert lookup.calls == 2, "unknown keys are cached too, so a flood of them does not reach the database"


async def test_expired_entries_are_looked_up_again() -> None:
    lookup = CountingLookup()
    auth = KeyAuthenticator(lookup, ttl_s=0)
    await auth.authenticate(f"Bearer {GOOD}")
    await auth.authenticate(f"Bearer {GOOD}")
    assert lookup.calls == 2


async def test_concurrent_misses_share_one_lookup() -> None:
    lookup = CountingLookup(delay=0.05)
    auth = KeyAuthenticator(lookup, ttl_s=10)
    results = await asyncio.gather(*[auth.authenticate(f"Bearer {GOOD}") for _ in range(20)])
    assert results == [WHO] * 20
    assert lookup.calls == 1


async def test_cache_is_bounded() -> None:
    auth = KeyAuthenticator(CountingLookup(), ttl_s=10, max_entries=10)
    for i in range(50):
        with pytest.raises(Unauthorized):
            await auth.authenticate(f"Bearer sk-sy-{i}")
    assert len(auth._cache) == 10


async def test_lookup_failure_reaches_every_waiter() -> None:
    def broken(_digest: str) -> KeyIdentity | None:
        time.sleep(0.02)
        raise RuntimeError("database down")

    auth = KeyAuthenticator(broken, ttl_s=10)
    results = await asyncio.gather(*[auth.authenticate(f"Bearer {GOOD}") for _ in range(5)], return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


class Database:
    """A key lookup whose database can be taken down (it then raises what SQLAlchemy raises)."""

    def __init__(self) -> None:
        self.down = False
        self.calls = 0

    def __call__(self, digest: str) -> KeyIdentity | None:
        self.calls += 1
        if self.down:
            raise OperationalError("SELECT ...", {}, ConnectionRefusedError("connection refused"))
        return WHO if digest == hash_key(GOOD) else None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def outage_auth(database: Database, counted: list[str], clock: Clock) -> KeyAuthenticator:
    return KeyAuthenticator(database, ttl_s=1.0, counted=counted.append, backoff_s=1.0, clock=clock)


async def test_fail_open_keeps_known_keys_on_their_expired_entry_and_refuses_unknown_ones() -> None:
    database, clock = Database(), Clock()
    counted: list[str] = []
    auth = outage_auth(database, counted, clock)
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO
    with pytest.raises(Unauthorized):
        await auth.authenticate("Bearer sk-sy-known-bad")
    database.down = True
    clock.now += 5  # every entry expired
    assert await auth.authenticate(f"Bearer {GOOD}", "fail_open") == WHO
    assert await auth.authenticate(f"Bearer {GOOD}", "fail_open") == WHO
    with pytest.raises(Unauthorized):  # its last answer stands too
        await auth.authenticate("Bearer sk-sy-known-bad", "fail_open")
    with pytest.raises(Overloaded) as refused:
        await auth.authenticate("Bearer sk-sy-never-seen", "fail_open")
    error = refused.value
    assert (error.status_code, error.code) == (503, "auth_unavailable") and int(error.headers["Retry-After"]) >= 1
    assert counted == ["fail_open", "fail_open", "fail_open", "fail_closed"]
    assert auth.database_down


async def test_fail_closed_refuses_keys_whose_entry_expired_but_not_fresh_ones() -> None:
    database, clock = Database(), Clock()
    counted: list[str] = []
    auth = outage_auth(database, counted, clock)
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO
    database.down = True
    assert await auth.authenticate(f"Bearer {GOOD}", "fail_closed") == WHO  # still fresh: no lookup
    assert counted == [] and database.calls == 1
    clock.now += 5
    with pytest.raises(Overloaded, match="database is unreachable") as refused:
        await auth.authenticate(f"Bearer {GOOD}", "fail_closed")
    assert refused.value.code == "auth_unavailable" and counted == ["fail_closed"]


async def test_the_database_is_tried_again_after_the_backoff(caplog: pytest.LogCaptureFixture) -> None:
    database, clock = Database(), Clock()
    counted: list[str] = []
    auth = outage_auth(database, counted, clock)
    await auth.authenticate(f"Bearer {GOOD}")
    database.down = True
    clock.now += 5
    with caplog.at_level(logging.WARNING, logger="switchyard.auth"):
        for _ in range(5):
            assert await auth.authenticate(f"Bearer {GOOD}") == WHO
        assert database.calls == 2, "one failed lookup, then the back-off"
        clock.now += 1
        await auth.authenticate(f"Bearer {GOOD}")
        await auth.authenticate(f"Bearer {GOOD}")
        assert database.calls == 3, "one lookup per back-off tries the database again"
        database.down = False
        clock.now += 1
        assert await auth.authenticate(f"Bearer {GOOD}") == WHO
        assert database.calls == 4 and not auth.database_down
        assert await auth.authenticate(f"Bearer {GOOD}") == WHO  # cached again
    assert database.calls == 4 and counted == ["fail_open"] * 7
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # the outage once, not per request; the recovery once
    assert "OperationalError" in messages[0] and "succeed again" in messages[1]


async def test_concurrent_lookups_that_fail_each_fall_back() -> None:
    database, clock = Database(), Clock()
    counted: list[str] = []
    auth = outage_auth(database, counted, clock)
    await auth.authenticate(f"Bearer {GOOD}")
    database.down = True
    clock.now += 5
    results = await asyncio.gather(*[auth.authenticate(f"Bearer {GOOD}") for _ in range(5)])
    assert results == [WHO] * 5 and database.calls == 2 and len(counted) == 5


# --- key changes: dropped entries, the listener, the SQLite marker -------------------------------------------

OTHER = generate_key()
SIBLING = KeyIdentity(key_id=2, tenant_id=1, tenant="acme", tier="pro")
STRANGER = KeyIdentity(key_id=3, tenant_id=9, tenant="zeta", tier="free")


class Directory:
    """A key lookup over a table that the test changes (a revocation: the entry goes away)."""

    def __init__(self) -> None:
        self.table = {hash_key(GOOD): WHO, hash_key(OTHER): SIBLING}
        self.calls = 0

    def __call__(self, digest: str) -> KeyIdentity | None:
        self.calls += 1
        return self.table.get(digest)


async def test_forgetting_a_key_drops_its_entry_at_once_and_only_its_own() -> None:
    directory = Directory()
    auth = KeyAuthenticator(directory, ttl_s=3600)
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO
    assert await auth.authenticate(f"Bearer {OTHER}") == SIBLING
    del directory.table[hash_key(GOOD)]  # revoked
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO, "an hour's TTL: still cached"
    assert auth.forget(["key:1"]) == 1
    with pytest.raises(Unauthorized):
        await auth.authenticate(f"Bearer {GOOD}")
    calls = directory.calls
    assert await auth.authenticate(f"Bearer {OTHER}") == SIBLING and directory.calls == calls, "the sibling stays"


async def test_forgetting_a_tenant_drops_every_key_of_it() -> None:
    directory = Directory()
    directory.table[hash_key("sk-sy-stranger")] = STRANGER
    auth = KeyAuthenticator(directory, ttl_s=3600)
    for key in (GOOD, OTHER, "sk-sy-stranger"):
        await auth.authenticate(f"Bearer {key}")
    assert auth.forget(["tenant:1"]) == 2
    assert directory.calls == 3
    await auth.authenticate("Bearer sk-sy-stranger")
    assert directory.calls == 3, "another tenant's key is still cached"


async def test_a_notice_drops_its_target_and_names_the_acknowledgement() -> None:
    directory = Directory()
    auth = KeyAuthenticator(directory, ttl_s=3600)
    await auth.authenticate(f"Bearer {GOOD}")
    del directory.table[hash_key(GOOD)]
    assert auth.notice("abc123 0 key:1") == "abc123 0"
    with pytest.raises(Unauthorized):
        await auth.authenticate(f"Bearer {GOOD}")
    assert auth.notice("garbage") is None  # logged; every entry expired instead


async def test_a_lookup_in_flight_when_entries_are_dropped_is_not_cached() -> None:
    """It may have read the key before the revocation committed: its answer serves its own request only,
    and a request arriving after the drop does not join it."""
    directory = Directory()
    started, release = threading.Event(), threading.Event()

    def slow(digest: str) -> KeyIdentity | None:
        answer = directory(digest)  # read before the revocation
        started.set()
        release.wait(5)
        return answer

    auth = KeyAuthenticator(slow, ttl_s=3600)
    first = asyncio.create_task(auth.authenticate(f"Bearer {GOOD}"))
    await asyncio.to_thread(started.wait, 5)
    del directory.table[hash_key(GOOD)]
    auth.forget(["key:1"])
    second = asyncio.create_task(auth.authenticate(f"Bearer {GOOD}"))  # a lookup of its own, after the change
    await asyncio.sleep(0.05)
    release.set()
    assert await first == WHO
    with pytest.raises(Unauthorized):
        await second
    with pytest.raises(Unauthorized):
        await auth.authenticate(f"Bearer {GOOD}")


async def test_without_a_listener_nothing_cached_is_trusted() -> None:
    directory = Directory()
    auth = KeyAuthenticator(directory, ttl_s=3600, needs_listener=True)
    assert not auth.trusts_cache
    await auth.authenticate(f"Bearer {GOOD}")
    await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 2, "not listening: every request is looked up"
    auth.listening(True)
    await auth.authenticate(f"Bearer {GOOD}")
    await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 3 and auth.trusts_cache, "listening: one lookup (the cache was expired), then cached"
    auth.listening(False)
    await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 4


async def test_expired_entries_still_answer_under_fail_open_but_dropped_ones_do_not() -> None:
    database, clock = Database(), Clock()
    counted: list[str] = []
    auth = KeyAuthenticator(database, ttl_s=3600, counted=counted.append, clock=clock)
    assert await auth.authenticate(f"Bearer {GOOD}") == WHO
    auth.expire_all()  # e.g. the listener reconnected
    database.down = True
    assert await auth.authenticate(f"Bearer {GOOD}", "fail_open") == WHO
    auth.forget(["key:1"])  # a revocation heard
    clock.now += 5  # past the back-off
    with pytest.raises(Overloaded):
        await auth.authenticate(f"Bearer {GOOD}", "fail_open")


async def test_a_moved_marker_expires_the_cache_before_it_answers() -> None:
    directory = Directory()
    marker = [7]
    auth = KeyAuthenticator(directory, ttl_s=3600)
    auth.follow_marker(lambda: marker[0])
    await auth.authenticate(f"Bearer {GOOD}")
    await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 1
    del directory.table[hash_key(GOOD)]
    marker[0] = 8  # another process revoked something
    with pytest.raises(Unauthorized):
        await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 2


async def test_an_unreadable_marker_means_a_lookup() -> None:
    directory = Directory()
    auth = KeyAuthenticator(directory, ttl_s=3600)
    busy = [False]

    def marker() -> int:
        if busy[0]:
            raise sqlite3.OperationalError("database is locked")
        return 1

    auth.follow_marker(marker)
    await auth.authenticate(f"Bearer {GOOD}")
    busy[0] = True
    await auth.authenticate(f"Bearer {GOOD}")
    assert directory.calls == 2
