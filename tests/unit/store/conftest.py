"""The limit stores under test: every behaviour runs once in process and once on the real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from switchyard.store.limits import LimitStore, MemoryLimitStore
from tests.unit.store.redis_support import delete_prefix, redis_store, unique_prefix


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[LimitStore]:
    """An empty limit store: in process, then on Redis under a prefix of its own (deleted after)."""
    if request.param == "memory":
        yield MemoryLimitStore()
        return
    prefix = unique_prefix()
    limits = await redis_store(prefix)
    try:
        yield limits
    finally:
        await limits.aclose()
        await delete_prefix(prefix)
