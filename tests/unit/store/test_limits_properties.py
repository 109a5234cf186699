"""Properties of the limit stores over random sequences of reserve, reconcile, time and sweep.

A ledger model runs beside the store: with buckets that never refill, what each bucket has lost
must be the actual usage of every settled reservation plus the reserved amount of every other
one (outstanding, or expired and forgotten), and each reservation settles at most once. A second
property runs one random sequence on both stores, with refilling buckets, and wants the same
answers from both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.store.limits import Admission, Bucket, Charge, LimitStore, MemoryLimitStore
from tests.unit.store.redis_support import delete_prefix, redis_store, unique_prefix

LEDGER_BUCKETS = [Bucket(f"b{i}", capacity, 0, "tokens_per_day", "tokens")
                  for i, capacity in enumerate((100, 250, 1000))]
T0 = 1000.0

Op = tuple[Any, ...]


def operations(amounts: st.SearchStrategy[float], gaps: st.SearchStrategy[float]) -> st.SearchStrategy[list[Op]]:
    """Random sequences of reserve (charges, ttl), reconcile (which one, actual usage), wait and sweep."""
    bucket = st.integers(0, len(LEDGER_BUCKETS) - 1)
    return st.lists(st.one_of(
        st.tuples(st.just("reserve"), st.lists(st.tuples(bucket, amounts), max_size=4), st.sampled_from([5.0, 50.0])),
        st.tuples(st.just("reconcile"), st.integers(0, 60), st.dictionaries(bucket, amounts, max_size=3)),
        st.tuples(st.just("wait"), gaps),
        st.tuples(st.just("sweep")),
    ), max_size=40)


@dataclass
class _Held:
    id: str
    amounts: dict[str, float]
    expires_at: float
    open: bool = True


@dataclass
class Ledger:
    """What the stores must agree with: the consumption of each bucket, reservation by reservation."""

    consumed: dict[str, float] = field(default_factory=lambda: {b.key: 0.0 for b in LEDGER_BUCKETS})
    held: list[_Held] = field(default_factory=list)

    def fits(self, amounts: dict[str, float]) -> bool:
        capacity = {b.key: b.capacity for b in LEDGER_BUCKETS}
        return all(a <= capacity[k] and capacity[k] - self.consumed[k] >= a for k, a in amounts.items())


async def _check_ledger(store: LimitStore, ops: list[Op]) -> None:
    ledger, now, settled = Ledger(), T0, 0
    for op in ops:
        if op[0] == "reserve":
            charges = [Charge(LEDGER_BUCKETS[i], amount) for i, amount in op[1]]
            amounts: dict[str, float] = {}
            for c in charges:
                amounts[c.bucket.key] = amounts.get(c.bucket.key, 0.0) + c.amount
            admission = await store.reserve(charges, op[2], now=now)
            assert admission.admitted == ledger.fits(amounts)
            assert admission.never == any(a > next(b.capacity for b in LEDGER_BUCKETS if b.key == k)
                                          for k, a in amounts.items())
            if admission.reservation:
                ledger.held.append(_Held(admission.reservation, amounts, now + op[2]))
                for k, a in amounts.items():
                    ledger.consumed[k] += a
        elif op[0] == "reconcile" and ledger.held:
            held = ledger.held[op[1] % len(ledger.held)]
            actual = {LEDGER_BUCKETS[i].key: used for i, used in op[2].items()}
            live = held.open and held.expires_at > now
            assert await store.reconcile(held.id, actual, now=now) == live
            held.open = False
            if live:
                settled += 1
                for k, a in held.amounts.items():
                    ledger.consumed[k] += actual.get(k, a) - a
        elif op[0] == "wait":
            now += op[1]
        elif op[0] == "sweep":
            expired = sum(1 for h in ledger.held if h.open and h.expires_at <= now)
            assert 0 <= await store.sweep(now) <= expired
            assert await store.sweep(now) == 0
        states = await store.peek(LEDGER_BUCKETS, now=now)
        assert [s.level for s in states] == [b.capacity - ledger.consumed[b.key] for b in LEDGER_BUCKETS]
    # Settled or forgotten once, never again; the rest settle now, once.
    for held in ledger.held:
        live = held.open and held.expires_at > now
        assert await store.reconcile(held.id, {}, now=now) == live
        assert not await store.reconcile(held.id, {}, now=now)
        settled += live
    assert settled <= len(ledger.held)


def _on_memory(check: Callable[[LimitStore], Awaitable[None]]) -> None:
    asyncio.run(check(MemoryLimitStore()))


def _on_redis(check: Callable[[LimitStore], Awaitable[None]]) -> None:
    async def run() -> None:
        prefix = unique_prefix()
        store = await redis_store(prefix)
        try:
            await check(store)
        finally:
            await store.aclose()
            await delete_prefix(prefix)
    asyncio.run(run())


LEDGER_OPS = operations(st.integers(0, 300).map(float), st.integers(1, 30).map(float))


@settings(max_examples=300, deadline=None)
@given(LEDGER_OPS)
def test_memory_consumption_is_actual_usage_plus_what_is_held(ops: list[Op]) -> None:
    _on_memory(lambda store: _check_ledger(store, ops))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LEDGER_OPS)
def test_redis_consumption_is_actual_usage_plus_what_is_held(ops: list[Op]) -> None:
    _on_redis(lambda store: _check_ledger(store, ops))


REFILLING = [Bucket("tpm", 1200, 20, "tokens_per_minute", "tokens"),
             Bucket("rpm", 15, 0.25, "requests_per_minute", "requests"),
             Bucket("odd", 20000, 20000 / 60, "tokens_per_minute", "tokens")]


def _comparable(admission: Admission) -> tuple[Any, ...]:
    """An admission without its reservation id, which differs between any two stores."""
    return (admission.admitted, admission.refused_by, admission.retry_after_s, admission.never, admission.states)


async def _transcript(store: LimitStore, ops: list[Op]) -> list[Any]:
    """Everything ``store`` answers to ``ops`` (with ``REFILLING`` buckets), in order."""
    answers: list[Any] = []
    reservations: list[str] = []
    now = T0
    for op in ops:
        if op[0] == "reserve":
            admission = await store.reserve([Charge(REFILLING[i], a) for i, a in op[1]], op[2], now=now)
            answers.append(_comparable(admission))
            if admission.reservation:
                reservations.append(admission.reservation)
        elif op[0] == "reconcile" and reservations:
            actual = {REFILLING[i].key: used for i, used in op[2].items()}
            answers.append(await store.reconcile(reservations[op[1] % len(reservations)], actual, now=now))
        elif op[0] == "wait":
            now += op[1]
        answers.append(await store.peek(REFILLING, now=now))
    return answers


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations(st.floats(0, 1500, allow_subnormal=False), st.floats(0.001, 40)))
def test_both_stores_give_the_same_answers_to_the_last_bit(ops: list[Op]) -> None:
    on_memory: list[Any] = []
    on_redis: list[Any] = []

    async def record(into: list[Any], store: LimitStore) -> None:
        into.extend(await _transcript(store, ops))

    _on_memory(lambda store: record(on_memory, store))
    _on_redis(lambda store: record(on_redis, store))
    assert on_memory == on_redis
