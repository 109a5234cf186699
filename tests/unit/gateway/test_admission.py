"""Admission's HTTP side: headers as OpenAI writes them, 429s naming the limit, settling once, and what
happens while the shared limit store is down (fail_open: limits per process; fail_closed: 503)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import pytest

from switchyard.api.errors import Overloaded, RateLimited
from switchyard.decide.admit import LimitCharge, duration, limit_refusal
from switchyard.gateway.admission import Admitter, Lease, ratelimit_headers
from switchyard.gateway.attempts import refusal_error
from switchyard.policy.resilience import FailureMode
from switchyard.store.limits import Admission, Bucket, BucketState, Charge, MemoryLimitStore


def charge(limit: str = "tokens_per_minute", unit: str = "tokens", capacity: float = 1000, amount: float = 300,
           key: str = "t:1") -> LimitCharge:
    return LimitCharge(f"{key}:{limit}", limit, unit, capacity, 60.0, amount, "tier free")  # type: ignore[arg-type]


async def admit(admitter: Admitter, charges: list[LimitCharge], redis: FailureMode = "fail_open") -> Lease:
    """What the gateway makes of an admission: the lease, or the 429 the decisions word for a refusal."""
    lease, answer = await admitter.reserve(charges, redis)
    if not answer.admitted:
        raise refusal_error(limit_refusal(charges, answer), lease.headers)
    return lease


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
    # Equal shares left: the first bucket's; a spend limit has no header; nothing to show, no header.
    tied = ratelimit_headers([state("spend_per_month", "spend", 5, 0, 9),
                              state("tokens_per_minute", "tokens", 100, 50, 1),
                              state("tokens_per_day", "tokens", 1000, 500, 2)])
    assert tied == {"x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "50",
                    "x-ratelimit-reset-tokens": "1s"}
    assert ratelimit_headers([]) == {}


async def test_admit_refuse_and_settle_exactly_once() -> None:
    store = MemoryLimitStore()
    admitter = Admitter(store)
    lease = await admit(admitter, [charge(amount=700)])
    assert lease.headers["x-ratelimit-remaining-tokens"] == "300"
    with pytest.raises(RateLimited) as refused:
        await admit(admitter, [charge(amount=400)])
    error = refused.value
    assert (error.status_code, error.code, error.type, error.limit) == (429, "rate_limit_exceeded", "tokens",
                                                                        "tokens_per_minute")
    assert int(error.headers["Retry-After"]) >= 1 and error.headers["x-ratelimit-remaining-tokens"] == "300"
    assert "Rate limit reached for tokens_per_minute (tier free): limit 1000" in error.message
    await lease.settle(100, 0.0)  # used 100 of the 700 reserved: 600 come back
    await lease.settle(100, 0.0)  # and only once
    assert (await admit(admitter, [charge(amount=850)])).headers["x-ratelimit-remaining-tokens"] == "50"
    with pytest.raises(RateLimited) as huge:
        await admit(admitter, [charge(amount=5000)])
    assert huge.value.code == "request_too_large" and "Retry-After" not in huge.value.headers


class _Flaky(MemoryLimitStore):
    """A shared store that can be taken down and brought back; counts the reservations it was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    async def reserve(self, charges: Sequence[Charge], ttl_s: float, now: float | None = None) -> Admission:
        self.calls += 1
        if self.down:
            raise ConnectionError("redis is down")
        return await super().reserve(charges, ttl_s, now)

    async def reconcile(self, reservation: str, actual: Mapping[str, float], now: float | None = None) -> bool:
        if self.down:
            raise ConnectionError("redis is down")
        return await super().reconcile(reservation, actual, now)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admitter(store: _Flaky, counted: list[str], clock: _Clock | None = None) -> Admitter:
    return Admitter(store, counted.append, backoff_s=1.0, warn_every_s=30.0, clock=clock or _Clock())


async def test_fail_open_enforces_the_limits_in_process_and_settles_where_it_reserved() -> None:
    shared = _Flaky()
    counted: list[str] = []
    shared.down = True
    admitter = _admitter(shared, counted)
    lease = await admit(admitter, [charge(amount=700)], "fail_open")
    assert lease.store is admitter.local and lease.reservation is not None
    assert lease.headers["x-ratelimit-remaining-tokens"] == "300"
    with pytest.raises(RateLimited) as refused:  # the limit still holds, in this process
        await admit(admitter, [charge(amount=400)], "fail_open")
    assert refused.value.status_code == 429 and int(refused.value.headers["Retry-After"]) >= 1
    assert counted == ["fail_open", "fail_open"]
    await lease.settle(100, 0.0)  # 600 come back to the local bucket, not to the shared one
    assert (await admit(admitter, [charge(amount=850)], "fail_open")).headers["x-ratelimit-remaining-tokens"] == "50"
    assert shared.calls == 1, "after the failure the shared store is left alone for the back-off"


async def test_fail_closed_refuses_with_503_and_retry_after() -> None:
    shared = _Flaky()
    counted: list[str] = []
    shared.down = True
    admitter = _admitter(shared, counted)
    for _ in range(2):
        with pytest.raises(Overloaded) as refused:
            await admit(admitter, [charge()], "fail_closed")
        error = refused.value
        assert (error.status_code, error.code, error.type) == (503, "limits_unavailable", "overloaded_error")
        assert int(error.headers["Retry-After"]) >= 1
    assert counted == ["fail_closed", "fail_closed"]


async def test_the_store_is_tried_again_after_the_backoff_and_recovery_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    shared, clock = _Flaky(), _Clock()
    counted: list[str] = []
    admitter = _admitter(shared, counted, clock)
    before = await admit(admitter, [charge(amount=100)])  # reserved on the shared store
    assert before.store is shared
    shared.down = True
    with caplog.at_level(logging.WARNING, logger="switchyard.admission"):
        for _ in range(5):
            await admit(admitter, [charge(amount=10)])
        assert shared.calls == 2 and admitter.store_down  # one failure, then the back-off
        clock.now += 1.0
        await admit(admitter, [charge(amount=10)])
        await admit(admitter, [charge(amount=10)])
        assert shared.calls == 3, "one request per back-off tries the store again"
        shared.down = False
        await before.settle(100, 0.0)  # reserved on the shared store: settles there once it answers
        clock.now += 1.0
        after = await admit(admitter, [charge(amount=10)])
        assert after.store is shared and not admitter.store_down
        await admit(admitter, [charge(amount=10)])
    assert shared.calls == 5 and counted == ["fail_open"] * 7
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # the fallback once (not per request), the recovery once
    assert "limit store unreachable" in warnings[0] and "ConnectionError: redis is down" in warnings[0]
    assert "limit store answers again" in warnings[1]


async def test_fallback_warnings_repeat_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    shared, clock = _Flaky(), _Clock()
    counted: list[str] = []
    shared.down = True
    admitter = _admitter(shared, counted, clock)
    with caplog.at_level(logging.WARNING, logger="switchyard.admission"):
        for _ in range(40):  # 40 s of requests, one per second
            await admit(admitter, [charge(amount=1)])
            clock.now += 1.0
    assert len(counted) == 40
    assert len(caplog.records) == 2 and "30 requests since the last warning" in caplog.records[1].getMessage()


async def test_a_lease_whose_store_fails_on_settle_logs_and_does_not_raise() -> None:
    shared = _Flaky()
    lease = await admit(_admitter(shared, []), [charge()])
    shared.down = True
    await lease.settle(10, 0.0)
    assert lease.settled


async def test_no_limits_no_store_call() -> None:
    shared = _Flaky()
    shared.down = True
    lease = await admit(Admitter(shared), [], "fail_closed")
    assert lease.store is None and lease.headers == {} and shared.calls == 0
