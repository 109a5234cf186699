"""Key authentication: parsing, caching, one lookup per key at a time, bounded memory."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from switchyard.gateway.auth import KeyAuthenticator
from switchyard.gateway.errors import Unauthorized
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
