"""The gateway's flow controller on a real endpoint registry: go, queue, grant, shed, downgrade, leave."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import pytest

from switchyard.api.errors import ClientLeft, Overloaded
from switchyard.decide import flow as decide_flow
from switchyard.decide.classes import ClassDecision, classify
from switchyard.decide.pick import EndpointChoice
from switchyard.decide.refusals import Refusal
from switchyard.decide.views import Candidate
from switchyard.engines.endpoints import EndpointRegistry, EngineSignals
from switchyard.gateway.attempts import refusal_error
from switchyard.gateway.flow import FlowController, never
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.view import LiveView
from switchyard.policy import PolicySnapshot, compile_policy
from switchyard.policy.fleet import Model
from switchyard.state.memory import Memory
from switchyard.state.queues import Ticket
from tests.unit.policy.base import base, to_yaml

BIG = "http://127.0.0.1:9101"
SPARE = "http://127.0.0.1:9102"


@pytest.fixture
def snapshot() -> PolicySnapshot:
    doc = base()
    doc["pools"] = [
        {"name": "big", "region": "us-east", "served_model": "b", "endpoints": [BIG], "kv_cache_tokens": 10000,
         "max_num_seqs": 2, "batch_reserve_slots": 0},
        {"name": "spare", "region": "us-east", "served_model": "s", "endpoints": [SPARE], "kv_cache_tokens": 10000},
    ]
    doc["models"] = [
        {"name": "big", "pools": ["big"], "context_window": 8192, "price": {"input_per_mtok": 1, "output_per_mtok": 1},
         "on_saturation": {"downgrade_to": "spare", "classes": ["standard"]}},
        {"name": "spare", "pools": ["spare"], "context_window": 4096,
         "price": {"input_per_mtok": 1, "output_per_mtok": 1}},
    ]
    doc["routes"] = []
    doc["priorities"] = {
        "critical": {"max_queue_ms": 2000},
        "standard": {"max_queue_ms": 1000},
        "sheddable": {"max_queue_ms": 100, "shed_above_utilisation": 0.4},
        "low": {"max_queue_ms": 1500},
        "batch": {"lane": "batch", "max_queue_ms": 2000, "max_utilisation": 0.5},
    }
    doc["tiers"] = [{"name": t, "priority": t, "models": ["*"]}
                    for t in ("critical", "standard", "sheddable", "low", "batch")]
    doc["cache"] = []
    doc["tests"] = []
    return compile_policy(to_yaml(doc))


@pytest.fixture
def flow() -> FlowController:
    return FlowController(EndpointRegistry(), GatewayMetrics())


def cls(snapshot: PolicySnapshot, name: str) -> ClassDecision:
    return classify(snapshot, name, None, None)


def sample(flow: FlowController, name: str, **labels: str) -> float:
    value = flow.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


@dataclass
class Got:
    """What flow control's stage gave a request, and the queue's grant it holds until it reaches its endpoint."""

    model: Model
    downgraded_from: Model | None
    note: str | None
    waited_s: float
    ticket: Ticket | None


def view(flow: FlowController) -> LiveView:
    return LiveView(flow.endpoints, flow, Memory(), itertools.count(1).__next__, random.Random(0))


async def schedule(flow: FlowController, snapshot: PolicySnapshot, klass: str, tenant: str = "t",
                   model: str = "big", cost: int = 100, gone: asyncio.Event | None = None) -> Got:
    """The flow stage of the decision procedure for a request, its queue waits carried out by ``flow`` and its
    refusal raised as the gateway answers it (what the gateway's executor does)."""
    async def disconnected() -> None:
        if gone is None:
            await never()
        else:
            await gone.wait()

    klass_decision = cls(snapshot, klass)
    steps = decide_flow.schedule(snapshot, snapshot.models[model], klass_decision, cost, tenant, 500, None,
                                 view(flow))
    answer, ticket = None, None
    while True:
        try:
            effect = steps.send(answer)
        except StopIteration as done:
            outcome: decide_flow.Scheduled | Refusal = done.value
            break
        answer, ticket = await flow.wait(effect, disconnected)
    flow.counted(klass_decision.name, outcome)
    if isinstance(outcome, Refusal):
        raise refusal_error(outcome)
    return Got(outcome.model, outcome.downgraded_from, outcome.note, outcome.waited_s, ticket)


def fill(flow: FlowController, n: int = 2, url: str = BIG) -> None:
    for _ in range(n):
        flow.endpoints.acquire(url, 100)


def finish(flow: FlowController, url: str = BIG, pool: str = "big", service_s: float = 1.0) -> None:
    flow.endpoints.release(url, 100)
    flow.released(pool, service_s)


async def test_a_request_goes_at_once_while_the_pool_has_room(flow: FlowController,
                                                             snapshot: PolicySnapshot) -> None:
    fill(flow, 1)
    done = await schedule(flow, snapshot, "critical")
    assert done.model.name == "big" and done.ticket is None and done.waited_s == 0


async def test_at_saturation_requests_queue_and_higher_classes_are_granted_first(
        flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)  # max_num_seqs 2: saturated
    order: list[str] = []

    async def one(klass: str, label: str) -> None:
        got = await schedule(flow, snapshot, klass)
        order.append(label)
        flow.endpoints.acquire(BIG, 100)
        flow.dispatched(got.ticket)

    low = asyncio.create_task(one("low", "low"))
    await asyncio.sleep(0.01)
    critical = asyncio.create_task(one("critical", "critical"))
    await asyncio.sleep(0.01)
    assert flow.waiting() == 2
    assert sample(flow, "switchyard_queue_depth", pool="big", lane="interactive", **{"class": "low"}) == 1
    finish(flow)
    await critical
    assert order == ["critical"]
    finish(flow)
    await low
    assert order == ["critical", "low"]
    assert sample(flow, "switchyard_queue_depth", pool="big", lane="interactive", **{"class": "low"}) == 0
    assert sample(flow, "switchyard_queue_wait_seconds_count", pool="big", lane="interactive",
                  **{"class": "critical"}) == 1


async def test_one_freed_slot_is_granted_once(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    waiting = [asyncio.create_task(schedule(flow, snapshot, "critical")) for _ in range(3)]
    await asyncio.sleep(0.01)
    finish(flow)
    await asyncio.sleep(0.05)
    done = [t for t in waiting if t.done()]
    assert len(done) == 1  # the grant is in transit until it reaches its endpoint
    flow.endpoints.acquire(BIG, 100)
    flow.dispatched(done[0].result().ticket)
    await asyncio.sleep(0.05)
    assert sum(t.done() for t in waiting) == 1  # full again: nobody else is granted
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert flow.waiting() == 0


async def test_a_request_past_its_deadline_is_shed_with_503(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    with pytest.raises(Overloaded) as caught:
        await schedule(flow, snapshot, "critical")
    err = caught.value
    assert err.status_code == 503 and err.code == "queue_deadline_exceeded"
    assert err.headers is not None and err.headers["Retry-After"] == "2"
    assert "critical" in err.message
    assert flow.waiting() == 0
    assert sample(flow, "switchyard_shed_total", reason="deadline", **{"class": "critical"}) == 1


async def test_sheddable_requests_are_refused_at_once_above_their_threshold(
        flow: FlowController, snapshot: PolicySnapshot) -> None:
    flow.endpoints.acquire(BIG, 100)  # one of two sequence slots: utilisation 0.5 > 0.4
    with pytest.raises(Overloaded) as caught:
        await schedule(flow, snapshot, "sheddable")
    assert caught.value.code == "shed_utilisation"
    assert caught.value.headers == {"Retry-After": "1"}
    assert sample(flow, "switchyard_shed_total", reason="utilisation", **{"class": "sheddable"}) == 1
    # The same load lets a standard request through.
    assert (await schedule(flow, snapshot, "standard")).model.name == "big"


async def test_a_saturated_model_downgrades_the_classes_it_names(flow: FlowController,
                                                                 snapshot: PolicySnapshot) -> None:
    fill(flow)
    done = await schedule(flow, snapshot, "standard")
    assert done.model.name == "spare" and done.downgraded_from is not None
    assert done.downgraded_from.name == "big"
    assert done.note is not None and done.note.startswith("big -> spare: the pools of big are saturated")
    assert done.note.isascii()
    assert sample(flow, "switchyard_downgrades_total", reason="saturated", model="big",
                  **{"class": "standard"}) == 1
    # Critical is not one of the classes: it waits for big instead.
    waiting = asyncio.create_task(schedule(flow, snapshot, "critical"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    finish(flow)
    assert (await waiting).model.name == "big"


async def test_no_downgrade_to_a_saturated_model(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    for _ in range(101):  # spare: 10100 reserved tokens of 10000
        flow.endpoints.acquire(SPARE, 100)
    with pytest.raises(Overloaded) as caught:
        await schedule(flow, snapshot, "standard")
    assert caught.value.code == "queue_deadline_exceeded"


async def test_a_client_that_leaves_leaves_the_queue(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    gone = asyncio.Event()
    waiting = asyncio.create_task(schedule(flow, snapshot, "critical", gone=gone))
    await asyncio.sleep(0.01)
    assert flow.waiting() == 1
    gone.set()
    with pytest.raises(ClientLeft):
        await waiting
    assert flow.waiting() == 0
    assert sample(flow, "switchyard_queue_abandoned_total", **{"class": "critical"}) == 1
    # The slot it would have had goes to the next one.
    nxt = asyncio.create_task(schedule(flow, snapshot, "critical"))
    await asyncio.sleep(0.01)
    finish(flow)
    assert (await nxt).ticket is not None


async def test_a_cancelled_grant_does_not_block_the_pool(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    first = asyncio.create_task(schedule(flow, snapshot, "critical"))
    second = asyncio.create_task(schedule(flow, snapshot, "critical"))
    await asyncio.sleep(0.01)
    finish(flow)
    granted = await first
    flow.dispatched(granted.ticket)  # what the proxy does when it gives up before sending
    await asyncio.sleep(0.05)
    assert (await second).ticket is not None


async def test_the_predicted_wait_refuses_at_once(flow: FlowController, snapshot: PolicySnapshot) -> None:
    await schedule(flow, snapshot, "critical")  # the pool is known from now on
    for _ in range(5):  # five requests served for 1 s each: the mean service time is 1 s
        flow.endpoints.acquire(BIG, 100)
        finish(flow)
    fill(flow)  # 200 tokens in flight, saturated: it finishes 200 tokens per second
    queued = [asyncio.create_task(schedule(flow, snapshot, "critical", tenant=f"t{i}", cost=250)) for i in range(2)]
    await asyncio.sleep(0.01)
    # 500 tokens before a newcomer at 200 tokens/s: 2.5 s, over critical's 2 s deadline. Its own size
    # does not count (it waits only until it starts).
    with pytest.raises(Overloaded) as caught:
        await schedule(flow, snapshot, "critical", cost=1)
    assert caught.value.code == "queue_wait_too_long"
    assert caught.value.headers == {"Retry-After": "3"}
    assert "2.5 s" in caught.value.message
    assert sample(flow, "switchyard_shed_total", reason="predicted_wait", **{"class": "critical"}) == 1
    # One request fewer ahead: 1.25 s, within the deadline; it queues.
    queued[1].cancel()
    await asyncio.sleep(0.01)
    third = asyncio.create_task(schedule(flow, snapshot, "critical", cost=1))
    await asyncio.sleep(0.01)
    assert not third.done()
    for t in (*queued, third):
        t.cancel()
    await asyncio.gather(*queued, third, return_exceptions=True)


async def test_batch_waits_for_the_interactive_lane_and_its_ceiling(flow: FlowController,
                                                                    snapshot: PolicySnapshot) -> None:
    flow.endpoints.acquire(BIG, 100)  # utilisation 0.5: at the batch ceiling
    bulk = asyncio.create_task(schedule(flow, snapshot, "batch"))
    await asyncio.sleep(0.01)
    assert not bulk.done()
    # Interactive work still goes while the pool has room.
    assert (await schedule(flow, snapshot, "critical")).ticket is None
    flow.endpoints.acquire(BIG, 100)
    finish(flow)
    await asyncio.sleep(0.01)
    assert not bulk.done()  # still one in flight: utilisation 0.5
    finish(flow)
    got = await asyncio.wait_for(bulk, 1)
    assert got.ticket is not None and got.ticket.lane == "batch"


async def test_the_batch_lane_leaves_the_pools_reserved_slots_free(snapshot: PolicySnapshot) -> None:
    doc = snapshot.document.model_dump(by_alias=True, exclude_none=True)
    other = "http://127.0.0.1:9103"
    doc["pools"][0].update(endpoints=[BIG, other], batch_reserve_slots=1)  # 2 replicas x 2 slots, 1 kept free
    doc["priorities"]["batch"].pop("max_utilisation")  # the default ceiling, 0.95
    snap = compile_policy(to_yaml(doc))
    pool = snap.pools["big"]
    assert pool.batch_reserve_slots == 1
    flow = FlowController(EndpointRegistry(), GatewayMetrics())
    fill(flow, 2, BIG)
    # One replica full, the other idle: the least-loaded one is at 0, and one batch request may go there.
    assert flow.utilisation(pool, time.monotonic()) == 0.0
    assert flow.batch_utilisation(pool, time.monotonic()) == pytest.approx(0.75)  # (2 taken + 1 kept) / 4
    assert (await schedule(flow, snap, "batch")).ticket is None
    flow.endpoints.acquire(other, 100)
    # Three of four slots taken: the fourth is kept for interactive work.
    assert flow.batch_utilisation(pool, time.monotonic()) == 1.0
    bulk = asyncio.create_task(schedule(flow, snap, "batch"))
    await asyncio.sleep(0.01)
    assert not bulk.done()
    assert (await schedule(flow, snap, "critical")).ticket is None  # an interactive request takes it at once
    flow.endpoints.acquire(other, 100)
    finish(flow)
    await asyncio.sleep(0.01)
    assert not bulk.done()  # a freed slot becomes the kept one again
    finish(flow)
    got = await asyncio.wait_for(bulk, 1)  # two free: one may go
    assert got.ticket is not None and got.ticket.lane == "batch"
    # A reserve as big as the pool keeps all its slots but one.
    doc["pools"][0]["batch_reserve_slots"] = 9
    greedy = compile_policy(to_yaml(doc)).pools["big"]
    assert flow.batch_utilisation(greedy, time.monotonic()) == pytest.approx(1.25)  # 2 taken + 3 kept, of 4
    finish(flow, other)
    assert flow.batch_utilisation(greedy, time.monotonic()) == 1.0
    finish(flow, other)
    assert flow.batch_utilisation(greedy, time.monotonic()) == pytest.approx(0.75)  # none taken: one may go
    # Without max_num_seqs there are no slots to keep: the batch lane sees the plain utilisation.
    doc["pools"][0].pop("max_num_seqs")
    plain = compile_policy(to_yaml(doc)).pools["big"]
    assert flow.batch_utilisation(plain, time.monotonic()) == flow.utilisation(plain, time.monotonic())


def test_utilisation_combines_own_accounting_and_the_engines_signals() -> None:
    registry = EndpointRegistry(signal_max_age=3.0)
    state = registry.state(BIG)
    assert state.utilisation(0.0, 3.0, 1000, None) == 0.0
    registry.acquire(BIG, 250)
    assert state.utilisation(0.0, 3.0, 1000, None) == 0.25
    assert state.utilisation(0.0, 3.0, 1000, 2) == 0.5  # one of two sequence slots
    assert state.slots_used(0.0, 3.0) == 1
    # Another gateway's traffic shows in the scrape: KV usage 0.6 plus what was sent since.
    registry.record_scrape(BIG, EngineSignals(running=3, waiting=0, kv_usage=0.6, prefix_queries=0,
                                              prefix_hits=0), now=10.0)
    registry.acquire(BIG, 100)
    assert state.utilisation(10.0, 3.0, 1000, None) == pytest.approx(0.7)
    assert state.utilisation(10.0, 3.0, 1000, 4) == pytest.approx(1.0)  # 3 running + 1 sent since, of 4
    assert state.slots_used(10.0, 3.0) == 4 and state.slots_used(20.0, 3.0) == 2  # stale: own only
    assert state.utilisation(20.0, 3.0, 1000, None) == pytest.approx(0.35)  # stale scrape: own only
    # A queue inside the engine means saturated, until finished requests have let it in.
    registry.record_scrape(BIG, EngineSignals(running=4, waiting=2, kv_usage=0.5, prefix_queries=0,
                                              prefix_hits=0), now=30.0)
    assert state.utilisation(30.0, 3.0, 1000, None) == pytest.approx(1.5)
    registry.release(BIG, 100)
    registry.release(BIG, 250)
    assert state.utilisation(30.0, 3.0, 1000, None) == pytest.approx(0.15)


async def test_degrade_before_shedding(flow: FlowController, snapshot: PolicySnapshot) -> None:
    doc = snapshot.document.model_dump(by_alias=True, exclude_none=True)
    doc["models"][0]["on_saturation"]["classes"] = ["standard", "sheddable"]
    both = compile_policy(to_yaml(doc))
    flow.endpoints.acquire(BIG, 100)  # utilisation 0.5: above sheddable's 0.4, not saturated
    done = await schedule(flow, both, "sheddable")
    assert done.model.name == "spare"
    assert done.note is not None and "above the 0.4 threshold of class sheddable" in done.note
    assert sample(flow, "switchyard_downgrades_total", reason="shed_threshold", model="big",
                  **{"class": "sheddable"}) == 1
    # Standard is under its ceiling here: it stays on big.
    assert (await schedule(flow, both, "standard")).model.name == "big"


async def test_a_grant_in_transit_is_not_saturation(flow: FlowController, snapshot: PolicySnapshot) -> None:
    fill(flow)
    first = asyncio.create_task(schedule(flow, snapshot, "critical"))
    await asyncio.sleep(0.01)
    finish(flow)
    granted = await first  # in transit: the pool is at 0.5 with nobody waiting
    newcomer = asyncio.create_task(schedule(flow, snapshot, "standard"))
    await asyncio.sleep(0.01)
    assert not newcomer.done()  # it waits a moment instead of being downgraded
    flow.dispatched(granted.ticket)
    done = await asyncio.wait_for(newcomer, 1)
    assert done.model.name == "big" and done.downgraded_from is None


async def test_the_tick_shows_every_known_pools_utilisation(flow: FlowController, snapshot: PolicySnapshot) -> None:
    await schedule(flow, snapshot, "critical")
    flow.endpoints.acquire(BIG, 100)
    ticking = asyncio.create_task(flow.run())
    await asyncio.sleep(0.12)
    ticking.cancel()
    assert sample(flow, "switchyard_pool_utilisation", pool="big") == 0.5


# --- batch gives way ------------------------------------------------------------------------------

def test_utilisation_as_a_preempting_request_sees_it_leaves_the_yielders_out() -> None:
    registry = EndpointRegistry(signal_max_age=3.0)
    state = registry.state(BIG)
    registry.acquire(BIG, 200)
    registry.acquire(BIG, 300, yielding=True)
    assert state.utilisation(0.0, 3.0, 1000, 4) == pytest.approx(0.5)
    assert state.utilisation(0.0, 3.0, 1000, 4, preempting=True) == pytest.approx(0.25)
    assert state.utilisation(0.0, 3.0, 1000, None, preempting=True) == pytest.approx(0.2)
    # In a fresh scrape the yielder runs in the engine: it is left out of the engine's count too.
    registry.record_scrape(BIG, EngineSignals(running=4, waiting=0, kv_usage=0.5, prefix_queries=0,
                                              prefix_hits=0), now=10.0)
    assert state.utilisation(10.0, 3.0, 1000, 4) == pytest.approx(1.0)
    assert state.utilisation(10.0, 3.0, 1000, 4, preempting=True) == pytest.approx(0.75)
    registry.release(BIG, 300, yielding=True)
    assert (state.yielding, state.yielding_reserved) == (0, 0)
    assert state.utilisation(10.0, 3.0, 1000, 4) == state.utilisation(10.0, 3.0, 1000, 4, preempting=True)


class Running:
    """A batch-lane request in flight at ``url`` as the proxy registers it."""

    def __init__(self, flow: FlowController, url: str = BIG, pool: str = "big") -> None:
        self.flow, self.url, self.pool = flow, url, pool
        self.released = 0
        self.task = asyncio.create_task(self.run())
        self.outcome: str | None = None

    async def run(self) -> None:
        self.yielder = self.flow.yielding(self.url, 100, self.release)
        self.flow.endpoints.acquire(self.url, 100, yielding=True)
        try:
            await asyncio.sleep(10)
            self.outcome = "finished"
        except asyncio.CancelledError:
            self.outcome = "preempted" if self.yielder is not None and self.yielder.preempted else "cancelled"
            raise
        finally:
            self.release()

    def release(self) -> None:
        if not self.released:
            self.released += 1
            self.flow.endpoints.release(self.url, 100, yielding=True)
            self.flow.finished_yielding(self.yielder)


async def test_interactive_requests_preempt_the_youngest_batch_request_until_there_is_room(
        flow: FlowController, snapshot: PolicySnapshot) -> None:
    big = snapshot.pools["big"]
    old = Running(flow)
    await asyncio.sleep(0.01)
    young = Running(flow)
    await asyncio.sleep(0.01)
    # Both slots hold batch work: the pool is saturated, but not for an interactive request.
    assert flow.utilisation(big, 0.0) == 1.0
    assert flow.utilisation(big, 0.0, preempting=True) == 0.0
    done = await schedule(flow, snapshot, "standard")
    assert done.ticket is None and done.downgraded_from is None  # neither queued nor downgraded
    assert flow.make_room(big, BIG, 1.0, 0.0) == 1
    assert young.released == 1  # its place is given back at once, before its task sees the cancellation
    assert flow.utilisation(big, 0.0) == 0.5
    await asyncio.sleep(0.01)
    assert young.outcome == "preempted" and old.outcome is None
    assert sample(flow, "switchyard_preemptions_total", pool="big") == 1
    assert flow.make_room(big, BIG, 1.0, 0.0) == 0  # room now: nothing more is preempted
    old.task.cancel()
    await asyncio.gather(old.task, young.task, return_exceptions=True)
    assert old.outcome == "cancelled" and flow.make_room(big, BIG, 0.0, 0.0) == 0  # nobody left to preempt


async def test_batch_requests_see_the_whole_load_and_flow_control_off_preempts_nothing(
        snapshot: PolicySnapshot) -> None:
    flow = FlowController(EndpointRegistry(), GatewayMetrics())
    running = Running(flow)
    await asyncio.sleep(0.01)
    bulk = asyncio.create_task(schedule(flow, snapshot, "batch"))
    await asyncio.sleep(0.01)
    assert not bulk.done()  # at the batch ceiling 0.5: its own kind counts
    bulk.cancel()
    running.task.cancel()
    await asyncio.gather(bulk, running.task, return_exceptions=True)
    off = FlowController(EndpointRegistry(), GatewayMetrics(), enabled=False)
    assert off.yielding(BIG, 100, lambda: None) is None
    assert off.make_room(snapshot.pools["big"], BIG, 0.0, 0.0) == 0


def eight_slots(snapshot: PolicySnapshot) -> PolicySnapshot:
    """The policy with pool ``big`` at 8 sequence slots and the batch lane at its default ceiling."""
    doc = snapshot.document.model_dump(by_alias=True, exclude_none=True)
    doc["pools"][0].update(max_num_seqs=8)
    doc["priorities"]["batch"].pop("max_utilisation")
    return compile_policy(to_yaml(doc))


async def test_batch_work_keeps_off_an_interactive_prefill_and_gives_way_before_its_first_step(
        snapshot: PolicySnapshot) -> None:
    snap = eight_slots(snapshot)
    pool = snap.pools["big"]
    flow = FlowController(EndpointRegistry(), GatewayMetrics())
    registry = flow.endpoints
    now = time.monotonic()
    assert flow.batch_utilisation(pool, now) == 0.0
    # An interactive stream in its prefill: the endpoint is full for batch work, not for anyone else.
    registry.prefill_started(BIG)
    assert flow.batch_utilisation(pool, now) == 1.0
    assert flow.utilisation(pool, now) == 0.0 and flow.utilisation(pool, now, preempting=True) == 0.0
    bulk = asyncio.create_task(schedule(flow, snap, "batch"))
    await asyncio.sleep(0.01)
    assert not bulk.done()
    registry.prefill_ended(BIG, 0.2)
    flow.prefill_ended("big")  # its first byte: the waiting batch request goes at once
    got = await asyncio.wait_for(bulk, 1)
    assert got.ticket is not None and flow.batch_utilisation(pool, now) == 0.0
    assert registry.state(BIG).prefill_s == 0.2
    registry.prefill_started(BIG)
    registry.prefill_ended(BIG, None)  # ended without a first byte: the average does not move
    registry.prefill_started(BIG)
    registry.prefill_ended(BIG, 0.3)
    assert registry.state(BIG).prefilling == 0 and registry.state(BIG).prefill_s == pytest.approx(0.21)
    # A batch request sent less than half such a prefill ago most likely waits for its first engine step: it
    # gives way to an interactive newcomer even with room left; older ones (in their prefill step, or past
    # it) keep running.
    old = Running(flow)
    middle = Running(flow)
    young = Running(flow)
    await asyncio.sleep(0.01)
    old.yielder.started, middle.yielder.started = young.yielder.started - 0.3, young.yielder.started - 0.15
    assert flow.make_room(pool, BIG, 1.0, young.yielder.started + 0.1) == 1
    await asyncio.sleep(0.01)
    assert young.outcome == "preempted" and middle.outcome is None and old.outcome is None
    assert sample(flow, "switchyard_preemptions_total", pool="big") == 1
    for running in (old, middle):
        running.task.cancel()
    await asyncio.gather(old.task, middle.task, young.task, return_exceptions=True)


async def test_batch_prefills_go_to_an_endpoint_one_at_a_time(snapshot: PolicySnapshot) -> None:
    snap = eight_slots(snapshot)
    pool = snap.pools["big"]
    flow = FlowController(EndpointRegistry(), GatewayMetrics())
    registry = flow.endpoints
    state = registry.state(BIG)
    registry.acquire(BIG, 100, yielding=True)  # before any interactive first byte: no spacing is known
    assert not state.batch_prefilling(time.monotonic()) and flow.batch_utilisation(pool, time.monotonic()) < 1.0
    registry.release(BIG, 100, yielding=True)
    registry.prefill_started(BIG)
    registry.prefill_ended(BIG, 0.1)
    registry.acquire(BIG, 100, yielding=True)  # a batch request sent: most likely in its prefill for 0.1 s
    sent = state.batch_sent_at
    assert flow.batch_utilisation(pool, sent + 0.05) == 1.0
    assert flow.utilisation(pool, sent + 0.05, preempting=True) == 0.0  # interactive requests are not held up
    assert flow.batch_utilisation(pool, sent + 0.11) == pytest.approx(1 / 8)  # its own slot only
    # A batch request waiting meanwhile is granted once the window has passed (the pool is pumped then).
    flow.batch_sent("big", BIG)
    bulk = asyncio.create_task(schedule(flow, snap, "batch"))
    await asyncio.sleep(0.02)
    assert not bulk.done()
    got = await asyncio.wait_for(bulk, 1)
    assert got.ticket is not None and time.monotonic() - sent >= 0.1


def test_an_interactive_request_weighs_load_without_batch_work_and_prefills_twice() -> None:
    registry = EndpointRegistry(signal_max_age=3.0)
    state = registry.state(BIG)
    registry.acquire(BIG, 100)  # an interactive stream, in its prefill
    registry.prefill_started(BIG)
    registry.acquire(BIG, 100, yielding=True)
    registry.acquire(BIG, 100, yielding=True)
    now = state.batch_sent_at
    assert state.load(now, 3.0) == 3.0
    assert state.load(now, 3.0, preempting=True) == 2.0  # 3 - 2 batch requests + 1 prefill
    registry.prefill_ended(BIG, 0.05)
    assert state.load(now + 0.1, 3.0, preempting=True) == 1.0
    # The engine's own count (another gateway's requests) is weighed the same way.
    registry.record_scrape(BIG, EngineSignals(running=6, waiting=1, kv_usage=0.5, prefix_queries=0,
                                              prefix_hits=0), now=now + 1.0)
    assert state.load(now + 1.0, 3.0) == 7.0 and state.load(now + 1.0, 3.0, preempting=True) == 5.0


async def test_steering_sends_the_interactive_request_where_the_youngest_batch_request_is(
        snapshot: PolicySnapshot) -> None:
    doc = snapshot.document.model_dump(by_alias=True, exclude_none=True)
    doc["pools"][0].update(endpoints=[BIG, SPARE], max_num_seqs=1)
    doc["pools"][1]["endpoints"] = ["http://127.0.0.1:9103"]
    snap = compile_policy(to_yaml(doc))
    pool = snap.pools["big"]
    flow = FlowController(EndpointRegistry(), GatewayMetrics())
    older = Running(flow, BIG)
    await asyncio.sleep(0.01)
    younger = Running(flow, SPARE)
    await asyncio.sleep(0.01)
    choice = EndpointChoice(pool, BIG, 1.0, (), "max-score", 2, ())
    options = [Candidate(pool, BIG), Candidate(pool, SPARE)]
    steered = decide_flow.steer(choice, options, set(), 1.0, view(flow), time.monotonic())
    assert steered.url == SPARE and "youngest batch request" in steered.notes[-1]
    tried = decide_flow.steer(choice, options, {SPARE}, 1.0, view(flow), time.monotonic())
    assert tried.url == BIG  # already tried there
    # Not where more interactive streams are in their prefill than at the choice: its first step would carry them.
    flow.endpoints.prefill_started(SPARE)
    assert decide_flow.steer(choice, options, set(), 1.0, view(flow), time.monotonic()) is choice
    flow.endpoints.prefill_started(BIG)
    assert decide_flow.steer(choice, options, set(), 1.0, view(flow), time.monotonic()).url == SPARE
    younger.task.cancel()
    await asyncio.gather(younger.task, return_exceptions=True)
    free = EndpointChoice(pool, SPARE, 1.0, (), "max-score", 2, ())
    assert decide_flow.steer(free, options, set(), 1.0, view(flow), time.monotonic()) is free  # room without preempting
    older.task.cancel()
    await asyncio.gather(older.task, return_exceptions=True)


OTHER = "http://127.0.0.1:9103"


@pytest.fixture
def two_regions() -> PolicySnapshot:
    """Model ``big`` with a pool in each of two regions, one endpoint each."""
    doc = base()
    doc["pools"] = [
        {"name": f"big-{region}", "region": region, "served_model": "b", "endpoints": [url],
         "kv_cache_tokens": 10000, "max_num_seqs": 2, "batch_reserve_slots": 0}
        for region, url in (("us-east", BIG), ("eu-west", OTHER))]
    doc["models"] = [{"name": "big", "pools": ["big-us-east", "big-eu-west"], "context_window": 8192,
                      "price": {"input_per_mtok": 1, "output_per_mtok": 1}}]
    doc["routes"] = []
    doc["priorities"] = {"critical": {"max_queue_ms": 2000}}
    doc["tiers"] = [{"name": "critical", "priority": "critical", "models": ["*"]}]
    doc["cache"] = []
    doc["tests"] = []
    return compile_policy(to_yaml(doc))


async def test_a_pool_with_no_endpoint_in_service_has_no_room(flow: FlowController,
                                                               two_regions: PolicySnapshot) -> None:
    # eu-west's only endpoint is down (an outage): it must not look like an empty pool. With us-east full, a
    # request waits for us-east instead of being let through to crowd its engine.
    flow.endpoints.mark_down(OTHER, "connection refused")
    pool = two_regions.pools["big-eu-west"]
    assert flow.utilisation(pool, time.monotonic()) == float("inf")
    assert flow.batch_utilisation(pool, time.monotonic()) == float("inf")
    fill(flow)
    waiting = asyncio.create_task(schedule(flow, two_regions, "critical"))
    await asyncio.sleep(0.15)  # a few of the controller's ticks: the dead pool grants nothing
    assert not waiting.done() and flow.waiting() == 2  # queued at both pools, granted by neither
    finish(flow, BIG, "big-us-east")
    got = await waiting
    assert got.ticket is not None and got.ticket.granted_by == "big-us-east"


async def test_when_no_pool_of_the_model_is_in_service_the_request_goes_on_at_once(
        flow: FlowController, two_regions: PolicySnapshot) -> None:
    # Nothing to wait for: the request goes to its fallback plan (another model, or a 503 naming the outage).
    flow.endpoints.mark_down(BIG, "connection refused")
    flow.endpoints.mark_down(OTHER, "connection refused")
    got = await schedule(flow, two_regions, "critical")
    assert got.model.name == "big" and got.ticket is None and got.waited_s == 0


async def test_a_downgrade_threshold_keeps_headroom_for_the_classes_not_downgraded(
        snapshot: PolicySnapshot, flow: FlowController) -> None:
    doc = snapshot.document.model_dump(mode="json", exclude_none=True)
    doc["models"][0]["on_saturation"]["at_utilisation"] = 0.5
    headroom = compile_policy(to_yaml(doc))
    fill(flow, 1)  # one of big's two slots: utilisation 0.5
    done = await schedule(flow, headroom, "standard")
    assert done.model.name == "spare" and done.note is not None and "at least 0.5 full" in done.note
    assert sample(flow, "switchyard_downgrades_total", reason="headroom", model="big",
                  **{"class": "standard"}) == 1
    # The slot left is critical's (not downgraded) ...
    assert (await schedule(flow, headroom, "critical")).model.name == "big"
    # ... and without the threshold the standard request would have taken it.
    assert (await schedule(flow, snapshot, "standard")).model.name == "big"


async def test_a_request_whose_rule_says_so_waits_for_both_models(flow: FlowController,
                                                                      snapshot: PolicySnapshot) -> None:
    doc = snapshot.document.model_dump(mode="json", exclude_none=True)
    doc["models"][0]["on_saturation"]["wait_for_either"] = True
    either = compile_policy(to_yaml(doc))
    fill(flow)  # big saturated
    for _ in range(101):  # spare saturated too (10,100 tokens reserved of 10,000)
        flow.endpoints.acquire(SPARE, 100)
    waiting = asyncio.create_task(schedule(flow, either, "standard"))
    critical = asyncio.create_task(schedule(flow, either, "critical"))  # not downgraded: big only
    await asyncio.sleep(0.01)
    assert flow.waiting() == 3  # standard at big and spare, critical at big
    for _ in range(2):  # spare frees first
        finish(flow, SPARE, "spare")
    got = await waiting
    assert got.model.name == "spare" and got.downgraded_from is not None and got.downgraded_from.name == "big"
    assert got.ticket is not None and got.ticket.granted_by == "spare"
    assert got.note is not None and "one of spare's freed first" in got.note
    assert sample(flow, "switchyard_downgrades_total", reason="saturated", model="big",
                  **{"class": "standard"}) == 1
    assert not critical.done()
    finish(flow)
    assert (await critical).model.name == "big"


async def test_by_default_a_queued_request_waits_for_its_own_model_only(flow: FlowController,
                                                                        snapshot: PolicySnapshot) -> None:
    fill(flow)
    for _ in range(101):
        flow.endpoints.acquire(SPARE, 100)
    waiting = asyncio.create_task(schedule(flow, snapshot, "standard"))
    await asyncio.sleep(0.01)
    assert flow.waiting() == 1
    finish(flow, SPARE, "spare")
    await asyncio.sleep(0.05)
    assert not waiting.done()
    finish(flow)
    got = await waiting
    assert got.model.name == "big" and got.downgraded_from is None


async def test_the_batch_lane_keeps_as_many_lines_waiting_as_the_pool_has_slots(
        flow: FlowController, snapshot: PolicySnapshot) -> None:
    # big: one endpoint of max_num_seqs 2, so two batch lines may wait there; a third goes back to its job.
    assert decide_flow.batch_waiting_room(snapshot.pools["big"]) == 2
    assert decide_flow.batch_waiting_room(snapshot.pools["spare"]) == decide_flow.BATCH_WAITING_PER_ENDPOINT
    fill(flow, 1)  # utilisation 0.5: at the batch class's ceiling
    waiting = [asyncio.create_task(schedule(flow, snapshot, "batch")) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert flow.waiting() == 2
    with pytest.raises(Overloaded) as caught:
        await schedule(flow, snapshot, "batch")
    err = caught.value
    assert err.status_code == 503 and err.code == "batch_lane_full"
    assert err.headers is not None and int(err.headers["Retry-After"]) >= 1
    assert sample(flow, "switchyard_shed_total", reason="lane_full", **{"class": "batch"}) == 1
    # Interactive requests are not held by it.
    assert (await schedule(flow, snapshot, "critical")).model.name == "big"
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_the_batch_lanes_room_is_what_each_models_lane_takes_before_it_refuses(
        flow: FlowController, snapshot: PolicySnapshot) -> None:
    """What the batch worker claims at most: the lines every model's lane still takes (a full lane of one model
    takes none, another's takes its room), and a listener hears each batch line that leaves a queue."""
    big_room = decide_flow.batch_waiting_room(snapshot.pools["big"])
    spare_room = decide_flow.batch_waiting_room(snapshot.pools["spare"])
    assert flow.batch_room(snapshot) == big_room + spare_room == 2 + 16
    heard: list[int] = []
    flow.on_batch_room(lambda: heard.append(1))
    fill(flow, 1)  # big at the batch class's ceiling (0.5): its lines wait, two at most
    big = [asyncio.create_task(schedule(flow, snapshot, "batch")) for _ in range(big_room)]
    await asyncio.sleep(0.01)
    assert decide_flow.batch_lane_full((snapshot.pools["big"],), flow.queues)
    assert flow.batch_room(snapshot) == spare_room  # big's lane is full, spare's has all its room
    flow.endpoints.acquire(SPARE, 5000)  # spare at the ceiling too
    spare = [asyncio.create_task(schedule(flow, snapshot, "batch", model="spare")) for _ in range(spare_room)]
    await asyncio.sleep(0.01)
    assert flow.waiting() == big_room + spare_room and flow.batch_room(snapshot) == 0
    assert heard == []
    spare.pop().cancel()  # one line leaves spare's lane: room for one, and the worker is woken
    await asyncio.sleep(0.01)
    assert flow.batch_room(snapshot) == 1 and heard == [1]
    finish(flow)  # big has a free slot: its first waiting line is granted
    done = await big.pop(0)
    assert done.model.name == "big" and flow.batch_room(snapshot) == 2 and heard == [1, 1]
    for t in big + spare:
        t.cancel()


def test_a_worker_keeps_the_pools_slots_and_batch_waiting_room_in_flight(snapshot: PolicySnapshot) -> None:
    # big: one endpoint of two slots (and room for two waiting); spare: no max_num_seqs, sixteen of each.
    assert decide_flow.batch_lines_in_flight(snapshot) == (2 + 2) + (16 + 16)
    doc = snapshot.document.model_dump(mode="json", exclude_none=True)
    doc["pools"][1]["endpoints"] = [f"http://127.0.0.1:{9200 + i}" for i in range(40)]
    assert decide_flow.batch_lines_in_flight(compile_policy(to_yaml(doc))) == decide_flow.MAX_BATCH_LINES_IN_FLIGHT
