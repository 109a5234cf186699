"""Admission's HTTP side: headers as OpenAI writes them, 429s naming the limit, settling once, failing open."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pytest

from switchyard.decide.admit import LimitCharge
from switchyard.gateway.admission import Admitter, duration, ratelimit_headers
from switchyard.gateway.errors import RateLimited
from switchyard.store.limits import Admission, Bucket, BucketState, Charge, MemoryLimitStore


def charge(limit: str = "tokens_per_minute", unit: str = "tokens", capacity: float = 1000, amount: float = 300,
           key: str = "t:1") -> LimitCharge:
    return LimitCharge(f"{key}:{limit}", limit, unit, capacity, 60.0, amount, "tier free")  # type: ignore[arg-type]


def test_durations_read_like_openais() -> None:
    assert [duration(s) for s in (0.0, 0.0121, 1.0, 1.2, 59.5, 360, 3725)] == [
        "0ms", "13ms", "1s", "2s", "1m0s", "6m0s", "1h2m5s"]
    assert duration(math.inf) == "never"


def test_headers_come_from_the_tightest_bucket_of_each_unit() -> None:
    def state(limit: str, unit: str, capacity: float, remaining: float, reset: float) -> BucketState:
        return BucketState(Bucket(f"k:{limit}", capacity, 1, limit, unit), capacity, remaining, reset,  # type: ignore[arg-type]
                           remaining)

    headers = ratelimit_headers([state("tokens_per_minute", "tokens", 1000, 900, 6),
                                 state("tokens_per_day", "tokens", 10000, 500, 3600),
                                 state("requests_per_minute", "requests", 10, 9.5, 3)])
    assert headers == {"x-ratelimit-limit-tokens": "10000", "x-ratelimit-remaining-tokens": "500",
                       "x-ratelimit-reset-tokens": "1h0m0s", "x-ratelimit-limit-requests": "10",
                       "x-ratelimit-remaining-requests": "9", "x-ratelimit-reset-requests": "3s"}


async def test_admit_refuse_and_settle_exactly_once() -> None:
    store = MemoryLimitStore()
    admitter = Admitter(store)
    lease = await admitter.admit([charge(amount=700)])
    assert lease.headers["x-ratelimit-remaining-tokens"] == "300"
    with pytest.raises(RateLimited) as refused:
        await admitter.admit([charge(amount=400)])
    error = refused.value
    assert (error.status_code, error.code, error.type, error.limit) == (429, "rate_limit_exceeded", "tokens",
                                                                        "tokens_per_minute")
    assert int(error.headers["Retry-After"]) >= 1 and error.headers["x-ratelimit-remaining-tokens"] == "300"
    assert "Rate limit reached for tokens_per_minute (tier free): limit 1000" in error.message
    await lease.settle(100, 0.0)  # used 100 of the 700 reserved: 600 come back
    await lease.settle(100, 0.0)  # and only once
    assert (await admitter.admit([charge(amount=850)])).headers["x-ratelimit-remaining-tokens"] == "50"
    with pytest.raises(RateLimited) as huge:
        await admitter.admit([charge(amount=5000)])
    assert huge.value.code == "request_too_large" and "Retry-After" not in huge.value.headers


class _Down(MemoryLimitStore):
    async def reserve(self, charges: Sequence[Charge], ttl_s: float, now: float | None = None) -> Admission:
        raise ConnectionError("redis is down")

    async def reconcile(self, reservation: str, actual: Mapping[str, float], now: float | None = None) -> bool:
        raise ConnectionError("redis is down")


async def test_a_limit_store_that_is_down_admits_and_is_counted() -> None:
    errors: list[int] = []
    lease = await Admitter(_Down(), lambda: errors.append(1)).admit([charge()])
    assert lease.reservation is None and errors == [1]
    await lease.settle(10, 0.0)  # nothing to settle; no error


async def test_no_limits_no_store_call() -> None:
    lease = await Admitter(_Down()).admit([])
    assert lease.store is None and lease.headers == {}
