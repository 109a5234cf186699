"""The batch worker's pure parts: backoff and which class batch lines are sent in."""

from __future__ import annotations

from switchyard.batch.worker import MAX_BACKOFF_S, backoff_s, batch_class
from switchyard.decide.policy_tests import compile_checked
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
