"""Flow control's queues: the discipline (classes best first, start-time fair queuing between tenants), on a
virtual clock."""

from __future__ import annotations

import random

from switchyard.state.queues import EXPIRED, GRANTED, LEFT, FairQueue, PoolQueues, Ticket


def ticket(tenant: str = "t", rank: int = 0, cost: int = 100, now: float = 0.0, deadline: float = 10.0,
           lane: str = "interactive") -> Ticket:
    return Ticket(tenant, f"class{rank}", rank, lane, cost, 1.0, now, deadline)  # type: ignore[arg-type]


def drain(queue: FairQueue) -> list[Ticket]:
    out = []
    while (head := queue.head()) is not None:
        queue.grant(head, "p")
        out.append(head)
    return out


def test_higher_classes_go_first_and_a_class_is_fifo_for_one_tenant() -> None:
    queue = FairQueue()
    low = [ticket(rank=2) for _ in range(3)]
    high = [ticket(rank=0) for _ in range(2)]
    mid = ticket(rank=1)
    for t in (low[0], high[0], low[1], mid, low[2], high[1]):
        queue.push(t)
    assert drain(queue) == [*high, mid, *low]
    assert all(t.state == GRANTED for t in (*high, mid, *low))


def test_a_flooding_tenant_does_not_starve_its_neighbour() -> None:
    queue = FairQueue()
    flood = [ticket("noisy") for _ in range(50)]
    for t in flood:
        queue.push(t)
    quiet = [ticket("quiet") for _ in range(3)]
    for t in quiet:
        queue.push(t)
    order = drain(queue)
    # The quiet tenant's three requests alternate with the flood's first ones.
    assert [order.index(t) for t in quiet] == [1, 3, 5]


def test_fair_shares_are_counted_in_tokens() -> None:
    queue = FairQueue()
    big = [ticket("big", cost=1000) for _ in range(5)]
    small = [ticket("small", cost=100) for _ in range(30)]
    for t in big + small:
        queue.push(t)
    first = drain(queue)[:22]
    served = {"big": 0, "small": 0}
    for t in first:
        served[t.tenant] += t.cost
    # Each tenant gets about the same tokens, not the same number of requests.
    assert abs(served["big"] - served["small"]) <= 1000, served


def test_a_newcomer_starts_at_the_virtual_time_not_at_zero() -> None:
    queue = FairQueue()
    for _ in range(10):
        queue.push(ticket("a"))
    for _ in range(5):
        queue.grant(queue.head(), "p")  # type: ignore[arg-type]
    late = ticket("b")
    queue.push(late)
    # b starts at the virtual time (a's fifth start), so it does not get five turns in a row.
    order = drain(queue)
    assert order.index(late) <= 1
    assert order[2].tenant == "a"


def test_deadlines_expire_on_a_virtual_clock() -> None:
    queue = FairQueue()
    early = ticket(deadline=1.0)
    late = ticket(deadline=3.0)
    queue.push(late)
    queue.push(early)
    assert queue.next_deadline() == 1.0
    assert queue.expire(0.999) == []
    assert queue.expire(1.0) == [early]
    assert early.state == EXPIRED
    assert queue.depth() == 1 and queue.head() is late
    assert queue.next_deadline() == 3.0
    queue.grant(late, "p")
    assert queue.expire(10.0) == []  # a granted ticket never expires
    assert queue.next_deadline() is None


def test_a_ticket_in_several_queues_leaves_them_all() -> None:
    a, b = FairQueue(), FairQueue()
    t = ticket(cost=300)
    a.push(t)
    b.push(t)
    assert a.tokens_ahead(0) == b.tokens_ahead(0) == 300
    b.grant(t, "b")
    assert t.granted_by == "b"
    assert len(a) == 0 and a.head() is None and a.tokens_ahead(0) == 0
    other = ticket()
    a.push(other)
    other.leave(LEFT)
    assert len(a) == 0 and a.head() is None


def test_tokens_ahead_count_only_better_or_equal_classes() -> None:
    queue = FairQueue()
    queue.push(ticket(rank=0, cost=10))
    queue.push(ticket(rank=1, cost=20))
    queue.push(ticket(rank=2, cost=40))
    assert [queue.tokens_ahead(r) for r in range(3)] == [10, 30, 70]
    assert queue.depth(1) == 1 and queue.depth() == 3


def test_random_operations_keep_the_counts_true() -> None:
    rng = random.Random(7)
    queue = FairQueue()
    live: list[Ticket] = []
    now = 0.0
    for _ in range(2000):
        now += rng.random() * 0.01
        op = rng.random()
        if op < 0.5:
            t = ticket(f"t{rng.randrange(4)}", rank=rng.randrange(3), cost=rng.randrange(1, 500), now=now,
                       deadline=now + rng.random())
            queue.push(t)
            live.append(t)
        elif op < 0.75 and (head := queue.head()) is not None:
            assert head.rank == min(t.rank for t in live)
            queue.grant(head, "p")
        elif op < 0.85 and live:
            rng.choice(live).leave(LEFT)
        else:
            for t in queue.expire(now):
                assert t.deadline <= now
        live = [t for t in live if t.waiting]
        assert queue.depth() == len(live)
        assert queue.tokens_ahead(2) == sum(t.cost for t in live)


# --- a pool's two lanes ---------------------------------------------------------------------------

def test_one_grant_in_transit_at_a_time() -> None:
    pool = PoolQueues()
    first, second = ticket(), ticket()
    pool.interactive.push(first)
    pool.interactive.push(second)
    assert pool.next_grant(0.5, 0.5) is first
    pool.grant(first, "p")
    assert pool.next_grant(0.0, 0.0) is None  # first has not reached its endpoint yet
    assert not pool.has_room("interactive", 0.0, 1.0)
    assert pool.dispatched(first)
    assert not pool.dispatched(first)
    assert pool.next_grant(0.5, 0.5) is second
    assert pool.next_grant(1.0, 1.0) is None  # saturated
    assert pool.next_grant(0.9, 1.0) is second  # saturated only by work that gives way to it


def test_the_batch_lane_waits_for_an_empty_interactive_lane_and_its_ceiling() -> None:
    pool = PoolQueues()
    bulk = Ticket("b", "batch", 3, "batch", 100, 0.6, 0.0, 600.0)
    pool.batch.push(bulk)
    chat = ticket()
    pool.interactive.push(chat)
    assert pool.next_grant(0.1, 0.1) is chat
    pool.grant(chat, "p")
    pool.dispatched(chat)
    assert pool.next_grant(0.1, 0.7) is None  # over the batch ceiling (the batch lane sees all the load)
    assert pool.next_grant(0.5, 0.5) is bulk
    # A newcomer of either lane waits while somebody waits before it.
    assert not pool.has_room("batch", 0.0, 0.6)
    assert pool.has_room("interactive", 0.0, 1.0)  # the batch lane never holds up interactive work
    pool.grant(bulk, "p")
    assert pool.has_room("interactive", 0.0, 1.0)  # not even a batch grant in transit
    assert not pool.has_room("batch", 0.0, 0.6)
    pool.dispatched(bulk)
    assert pool.has_room("batch", 0.5, 0.6)
    assert not pool.has_room("batch", 0.6, 0.6)


def test_tokens_before_a_newcomer_follow_the_fair_order() -> None:
    queue = FairQueue()
    queue.push(ticket("other", rank=0, cost=50))
    for _ in range(10):
        queue.push(ticket("noisy", rank=1, cost=100))
    queue.push(ticket("quiet", rank=1, cost=100))
    assert queue.tokens_ahead(1) == 1150
    # A second request of the quiet tenant would have tag 100: after the better class, its own first
    # and the noisy tenant's first two (tags 0 and 100; the earlier arrival wins a tie).
    assert queue.tokens_before("quiet", 1) == 50 + 100 + 100 + 100
    # The noisy tenant's next one waits behind all of its own.
    assert queue.tokens_before("noisy", 1) == 50 + 1000 + 100
    assert queue.tokens_before("new", 2) == 1150
