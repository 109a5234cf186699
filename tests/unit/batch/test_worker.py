"""The batch worker's parts that need no database or engine: backoff, which class batch lines are sent in, and
how many lines it claims."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import create_engine

from switchyard.batch.worker import MAX_BACKOFF_S, BatchWorker, backoff_s, batch_class
from switchyard.decide.flow import batch_lines_in_flight
from switchyard.decide.policy_tests import compile_checked
from switchyard.decide.refusals import Refusal
from switchyard.gateway.attempts import refusal_error
from switchyard.policy import PolicySnapshot
from switchyard.store.batch_queue import ClaimedRequest
from tests.unit.policy.base import base, to_yaml


def test_backoff_doubles_from_two_seconds_up_to_five_minutes() -> None:
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff_s(20) == MAX_BACKOFF_S == 300.0


def test_lines_go_in_the_policys_batch_lane_class() -> None:
    doc = base()
    assert batch_class(compile_checked(to_yaml(doc))) == "batch"  # base() declares batch: {lane: batch}
    doc["priorities"] = {"bulk": {"lane": "batch"}, **{k: v for k, v in doc["priorities"].items() if k != "batch"}}
    assert batch_class(compile_checked(to_yaml(doc))) == "bulk"
    del doc["priorities"]["bulk"]
    assert batch_class(compile_checked(to_yaml(doc))) is None


async def _never_served(*_: Any) -> Any:
    raise AssertionError("no line is served in this test")


class Lanes:
    """Batch lanes that take ``room`` lines (what the gateway's flow controller says)."""

    def __init__(self) -> None:
        self.room = 0
        self.listeners: list[Callable[[], None]] = []

    def batch_room(self, snapshot: PolicySnapshot) -> int:
        return self.room

    def on_batch_room(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)


async def test_the_worker_claims_what_the_batch_lanes_take_and_claims_again_when_one_has_room() -> None:
    """No more lines than the lanes take (none while every lane is full), and a wait for room ends as soon as a
    lane has room. (It used to claim its whole free room, hand back what the lanes refused and pause a quarter
    of a second: in the headline bench the small model's fast lines drained its lane during each pause.)"""
    snapshot = compile_checked(to_yaml(base()))
    lanes = Lanes()
    worker = BatchWorker(create_engine("sqlite://"), _never_served, lambda: snapshot, concurrency=None, lease_s=60,
                         max_attempts=3, lanes=lanes)
    assert worker.concurrency == batch_lines_in_flight(snapshot)
    assert worker._claimable() == 0
    lanes.room = 5
    assert worker._claimable() == 5
    lanes.room = 100_000
    assert worker._claimable() == worker.concurrency
    assert BatchWorker(create_engine("sqlite://"), _never_served, lambda: snapshot, concurrency=7, lease_s=60,
                       max_attempts=3)._claimable() == 7  # set, and no lanes to ask
    waiting = asyncio.create_task(worker._until_room(30.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    for listener in lanes.listeners:
        listener()
    await asyncio.wait_for(waiting, 1.0)


async def test_a_line_a_full_lane_refused_goes_back_after_its_retry_after() -> None:
    snapshot = compile_checked(to_yaml(base()))
    worker = BatchWorker(create_engine("sqlite://"), _never_served, lambda: snapshot, concurrency=4, lease_s=60,
                         max_attempts=3)
    error = refusal_error(Refusal(503, "batch_lane_full", "full", retry_after_s=7.0, shed="lane_full"))
    now = datetime.now(UTC)
    for row in (1, 2):
        line = ClaimedRequest(row, "batch_1", 1, 1, "/v1/chat/completions", f"l{row}", {}, 1, now)
        await worker._lane_full(line, error, {"code": "batch_lane_full"})
    # Both go back to their job's queue together at the loop's next round, due after the refusal's Retry-After.
    assert [(row, delay) for row, delay, *_ in worker._lane_returns] == [(1, 7.0), (2, 7.0)]
