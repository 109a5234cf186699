"""The limit stores' behaviour, each test run in process and on the real Redis, at explicit times."""

from __future__ import annotations

import math
import os

import pytest

from switchyard.store.limits import Bucket, BucketState, Charge, LimitStore, MemoryLimitStore
from switchyard.store.limits.arithmetic import SWEEP_BATCH, new_reservation_id

# Full from empty in 60 s, 60 s and 8000 s; the last one never refills.
TPM = Bucket("t:1:tokens_per_minute", 1200, 20, "tokens_per_minute", "tokens")
RPM = Bucket("t:1:requests_per_minute", 15, 0.25, "requests_per_minute", "requests")
TPD = Bucket("t:1:tokens_per_day", 4000, 0.5, "tokens_per_day", "tokens")
CREDITS = Bucket("t:1:credits", 100, 0, "credits", "spend")
T = 1000.0


async def level(store: LimitStore, bucket: Bucket, now: float) -> float:
    return (await store.peek([bucket], now=now))[0].level


async def test_a_new_bucket_starts_full_and_an_admission_takes_the_amount(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 200)], 60, now=T)
    assert admission.admitted and admission.reservation
    assert (admission.refused_by, admission.retry_after_s, admission.never) == (None, None, False)
    assert admission.states == [BucketState(TPM, limit=1200.0, remaining=1000.0, reset_s=10.0, level=1000.0)]


async def test_buckets_refill_continuously_up_to_their_capacity(store: LimitStore) -> None:
    assert (await store.reserve([Charge(TPM, 1200)], 60, now=T)).states[0].remaining == 0
    [state] = await store.peek([TPM], now=T + 2.5)
    assert (state.remaining, state.reset_s) == (50.0, 57.5)
    refused = await store.reserve([Charge(TPM, 100)], 60, now=T + 2)
    assert not refused.admitted and not refused.never
    assert (refused.refused_by, refused.retry_after_s, refused.states[0].remaining) == (TPM, 3.0, 40.0)
    assert (await store.reserve([Charge(TPM, 100)], 60, now=T + 5)).admitted
    [full] = await store.peek([TPM], now=T + 1000)
    assert (full.remaining, full.reset_s) == (1200.0, 0.0)


async def test_no_double_burst_across_a_window_boundary(store: LimitStore) -> None:
    assert (await store.reserve([Charge(TPM, 1200)], 60, now=T + 59.5)).admitted
    refused = await store.reserve([Charge(TPM, 1200)], 60, now=T + 60.5)
    assert not refused.admitted
    assert (refused.states[0].remaining, refused.retry_after_s) == (20.0, 59.0)


async def test_a_refusal_takes_nothing_from_any_bucket(store: LimitStore) -> None:
    assert (await store.reserve([Charge(RPM, 15)], 60, now=T)).admitted
    refused = await store.reserve([Charge(TPM, 100), Charge(RPM, 1)], 60, now=T)
    assert not refused.admitted and refused.reservation is None
    assert (refused.refused_by, refused.retry_after_s) == (RPM, 4.0)
    assert [s.remaining for s in refused.states] == [1200.0, 0.0]
    assert await level(store, TPM, T) == 1200.0


async def test_the_bucket_with_the_longest_wait_refuses(store: LimitStore) -> None:
    assert (await store.reserve([Charge(TPM, 1200), Charge(RPM, 15)], 60, now=T)).admitted
    tokens_short = await store.reserve([Charge(RPM, 1), Charge(TPM, 100)], 60, now=T)
    assert (tokens_short.refused_by, tokens_short.retry_after_s) == (TPM, 5.0)
    requests_short = await store.reserve([Charge(TPM, 20), Charge(RPM, 2)], 60, now=T)
    assert (requests_short.refused_by, requests_short.retry_after_s) == (RPM, 8.0)


async def test_an_amount_above_capacity_is_never_admitted(store: LimitStore) -> None:
    assert (await store.reserve([Charge(RPM, 15)], 60, now=T)).admitted
    refused = await store.reserve([Charge(RPM, 1), Charge(TPM, 1201)], 60, now=T)
    assert not refused.admitted and refused.never
    assert (refused.refused_by, refused.retry_after_s) == (TPM, None)
    assert await level(store, TPM, T) == 1200.0
    exactly_full = await store.reserve([Charge(TPM, 1200)], 60, now=T)
    assert exactly_full.admitted and not exactly_full.never


async def test_waiting_retry_after_is_exactly_enough(store: LimitStore) -> None:
    bucket = Bucket("t:2:tokens_per_minute", 20000, 20000 / 60, "tokens_per_minute", "tokens")
    assert (await store.reserve([Charge(bucket, 19999.5)], 60, now=1000.25)).admitted
    refused = await store.reserve([Charge(bucket, 7777)], 60, now=1003.1)
    wait = refused.retry_after_s
    assert wait is not None and not refused.admitted
    assert wait == pytest.approx((7777 - refused.states[0].level) / bucket.refill_per_s, abs=0.002)
    assert wait == round(wait, 3)  # whole milliseconds
    assert not (await store.reserve([Charge(bucket, 7777)], 60, now=1003.1 + wait - 0.001)).admitted
    assert (await store.reserve([Charge(bucket, 7777)], 60, now=1003.1 + wait)).admitted


async def test_states_report_limit_remaining_and_reset(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 300), Charge(RPM, 3), Charge(CREDITS, 10)], 60, now=T)
    assert [(s.bucket, s.limit, s.remaining, s.reset_s) for s in admission.states] == [
        (TPM, 1200.0, 900.0, 15.0), (RPM, 15.0, 12.0, 12.0), (CREDITS, 100.0, 90.0, math.inf)]
    refused = await store.reserve([Charge(TPM, 1000), Charge(RPM, 1)], 60, now=T + 1)
    assert [(s.remaining, s.reset_s) for s in refused.states] == [(920.0, 14.0), (12.25, 11.0)]


async def test_a_bucket_that_never_refills_refuses_without_a_wait(store: LimitStore) -> None:
    spent = await store.reserve([Charge(CREDITS, 100)], 86_400, now=T)
    assert spent.admitted and spent.reservation
    refused = await store.reserve([Charge(CREDITS, 1)], 60, now=T + 10_000)
    assert (refused.admitted, refused.never, refused.retry_after_s) == (False, False, None)
    assert await store.reconcile(spent.reservation, {CREDITS.key: 40}, now=T + 10_000)
    assert (await store.reserve([Charge(CREDITS, 60)], 60, now=T + 10_000)).admitted


async def test_reconcile_gives_back_what_was_not_used(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 500)], 60, now=T)
    assert admission.reservation
    assert await store.reconcile(admission.reservation, {TPM.key: 200}, now=T)
    assert await level(store, TPM, T) == 1000.0


async def test_a_give_back_never_fills_a_bucket_above_capacity(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 500)], 60, now=T)
    assert admission.reservation
    assert await level(store, TPM, T + 20) == 1100.0
    assert await store.reconcile(admission.reservation, {TPM.key: 0}, now=T + 20)
    assert await level(store, TPM, T + 20) == 1200.0


async def test_usage_beyond_the_reservation_is_charged_even_below_zero(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 1000)], 60, now=T)
    assert admission.reservation
    assert await store.reconcile(admission.reservation, {TPM.key: 2000}, now=T)
    [state] = await store.peek([TPM], now=T)
    assert (state.level, state.remaining, state.reset_s) == (-800.0, 0.0, 100.0)
    in_debt = await store.reserve([Charge(TPM, 0)], 60, now=T)
    assert (in_debt.admitted, in_debt.retry_after_s) == (False, 40.0)
    assert (await store.reserve([Charge(TPM, 100)], 60, now=T + 45)).admitted


async def test_keys_left_out_keep_their_reservation_and_unknown_keys_are_ignored(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 300), Charge(RPM, 2)], 60, now=T)
    assert admission.reservation
    other = Bucket("t:9:tokens_per_minute", 10, 1, "tokens_per_minute", "tokens")
    assert await store.reconcile(admission.reservation, {RPM.key: 1, other.key: 50}, now=T)
    assert [s.level for s in await store.peek([TPM, RPM, other], now=T)] == [900.0, 14.0, 10.0]


async def test_a_reservation_is_settled_exactly_once(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 500)], 60, now=T)
    assert admission.reservation
    assert await store.reconcile(admission.reservation, {TPM.key: 500}, now=T)
    assert not await store.reconcile(admission.reservation, {TPM.key: 0}, now=T)
    assert await level(store, TPM, T) == 700.0
    assert not await store.reconcile("no-such-reservation", {}, now=T)


async def test_an_expired_reservation_is_forgotten_without_refund(store: LimitStore) -> None:
    expiring = await store.reserve([Charge(TPM, 500)], 10, now=T)
    lasting = await store.reserve([Charge(TPM, 100)], 10.001, now=T)
    assert expiring.reservation and lasting.reservation
    assert not await store.reconcile(expiring.reservation, {TPM.key: 0}, now=T + 10)
    assert await store.reconcile(lasting.reservation, {TPM.key: 0}, now=T + 10)
    # 600 taken, 200 refilled, the lasting 100 given back: the expired 500 stay spent.
    assert await level(store, TPM, T + 10) == 900.0


async def test_sweep_forgets_expired_reservations_and_counts_them(store: LimitStore) -> None:
    ids = [(await store.reserve([Charge(TPD, 100)], ttl, now=T)).reservation for ttl in (5, 10, 100)]
    assert await store.sweep(T + 4) == 0
    assert await store.sweep(T + 10) == 2
    assert await store.sweep(T + 10) == 0
    first, _, last = ids
    assert first and last
    assert not await store.reconcile(first, {TPD.key: 0}, now=T + 10)
    assert await store.reconcile(last, {TPD.key: 0}, now=T + 10)
    assert await level(store, TPD, T + 10) == 3805.0


async def test_every_reserve_forgets_a_bounded_batch_of_expired_reservations(store: LimitStore) -> None:
    for _ in range(SWEEP_BATCH + 4):
        assert (await store.reserve([Charge(TPD, 1)], 1, now=T)).admitted
    assert (await store.reserve([Charge(TPD, 1)], 1, now=T + 2)).admitted
    assert await store.sweep(T + 2) == 4


async def test_charges_of_one_bucket_add_up(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPM, 100), Charge(RPM, 1), Charge(TPM, 50)], 60, now=T)
    assert admission.reservation
    assert [(s.bucket, s.remaining) for s in admission.states] == [(TPM, 1050.0), (RPM, 14.0)]
    assert await store.reconcile(admission.reservation, {TPM.key: 120}, now=T)
    assert await level(store, TPM, T) == 1080.0


async def test_no_charges_admit_with_a_reservation(store: LimitStore) -> None:
    admission = await store.reserve([], 60, now=T)
    assert admission.admitted and admission.reservation and admission.states == []
    assert await store.reconcile(admission.reservation, {}, now=T)


async def test_a_clock_that_goes_back_credits_no_interval_twice(store: LimitStore) -> None:
    assert (await store.reserve([Charge(TPM, 1200)], 60, now=T)).admitted
    assert await level(store, TPM, T - 5) == 0.0
    refused = await store.reserve([Charge(TPM, 1)], 60, now=T - 5)
    assert (refused.admitted, refused.retry_after_s) == (False, 0.05)
    assert await level(store, TPM, T + 1) == 20.0


async def test_a_lower_capacity_caps_what_a_bucket_holds(store: LimitStore) -> None:
    assert (await store.reserve([Charge(TPM, 100)], 60, now=T)).admitted
    smaller = Bucket(TPM.key, 500, 20, "tokens_per_minute", "tokens")
    assert await level(store, smaller, T) == 500.0


async def test_without_now_the_store_reads_its_own_clock(store: LimitStore) -> None:
    admission = await store.reserve([Charge(TPD, 100)], 60)
    assert admission.reservation and admission.states[0].remaining == 3900.0
    refused = await store.reserve([Charge(TPD, 4000)], 60)
    assert not refused.admitted and refused.retry_after_s is not None and 0 < refused.retry_after_s <= 200
    assert await store.reconcile(admission.reservation, {})
    assert await store.sweep() == 0


async def test_malformed_calls_are_refused_and_change_nothing(store: LimitStore) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        await store.reserve([Charge(TPM, 1)], 0, now=T)
    with pytest.raises(ValueError, match="two different buckets"):
        await store.reserve([Charge(TPM, 1), Charge(Bucket(TPM.key, 10, 1, "x", "tokens"), 1)], 60, now=T)
    admission = await store.reserve([Charge(TPM, 1)], 60, now=T)
    assert admission.reservation
    with pytest.raises(ValueError, match="actual usage"):
        await store.reconcile(admission.reservation, {TPM.key: -1}, now=T)
    assert await level(store, TPM, T) == 1199.0
    assert await store.reconcile(admission.reservation, {TPM.key: 1}, now=T)


@pytest.mark.parametrize(("capacity", "refill", "amount"), [
    (0, 1, 1), (math.inf, 1, 1), (10, -1, 1), (10, math.nan, 1), (10, 1, -1), (10, 1, math.nan), (10, 1, math.inf)])
def test_buckets_and_charges_hold_finite_non_negative_numbers(capacity: float, refill: float, amount: float) -> None:
    with pytest.raises(ValueError, match="must be a finite number"):
        Charge(Bucket("k", capacity, refill, "tokens_per_minute", "tokens"), amount)


async def test_the_memory_store_forgets_full_buckets_on_sweep() -> None:
    store = MemoryLimitStore()
    assert (await store.reserve([Charge(TPM, 100)], 1, now=T)).admitted
    assert (await store.reserve([Charge(CREDITS, 1)], 1, now=T)).admitted
    assert await store.sweep(T + 4) == 2
    assert len(store._buckets) == 2
    assert await store.sweep(T + 5) == 0
    # TPM is full again and an absent bucket reads as full; CREDITS never refills and stays.
    assert list(store._buckets) == [CREDITS.key]
    assert await level(store, TPM, T + 5) == 1200.0


async def test_the_memory_store_index_stays_within_twice_the_outstanding_reservations() -> None:
    store = MemoryLimitStore()
    kept = []
    for i in range(2000):
        admission = await store.reserve([Charge(TPD, 1)], 10_000, now=T + i)
        assert admission.reservation
        if i % 10:
            assert await store.reconcile(admission.reservation, {TPD.key: 0}, now=T + i)
        else:
            kept.append(admission.reservation)
        assert len(store._expiries) <= 2 * len(kept) + 65
    assert await store.sweep(T + 20_000) == 200


def test_reservation_ids_are_unique_in_a_process_and_across_a_fork() -> None:
    ids = [new_reservation_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child draws its own ids, not the parent's next ones
        os.write(write, " ".join(new_reservation_id() for _ in range(3)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    child = os.read(read, 1000).decode().split()
    os.close(read)
    parent = [new_reservation_id() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(parent + ids)
    assert {c[:16] for c in child} != {p[:16] for p in parent}
