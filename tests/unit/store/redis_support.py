"""The real Redis for the limit-store tests: a store under a prefix of its own, and its cleanup."""

from __future__ import annotations

import os
import uuid

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from switchyard.store.limits import RedisLimitStore, create_limit_store

# The Redis server these machines run. A test that needs it fails, loudly, when it does not
# answer: CI must never pass by skipping the shared backend.
REDIS_URL = os.environ.get("SWITCHYARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def unique_prefix() -> str:
    """A key prefix no other test uses."""
    return f"sytest:{uuid.uuid4().hex[:12]}:"


async def redis_store(prefix: str) -> RedisLimitStore:
    """A Redis store under ``prefix``, as the gateway makes it; fails the test if Redis does not answer."""
    client = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except RedisConnectionError as exc:
        pytest.fail(f"Redis at {REDIS_URL} does not answer ({exc}); start it (see .ci/run)")
    finally:
        await client.aclose()
    store = create_limit_store(REDIS_URL, key_prefix=prefix)
    assert isinstance(store, RedisLimitStore)
    return store


async def delete_prefix(prefix: str) -> None:
    """Delete every key under ``prefix``."""
    client = Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
