"""Flow control's pure decisions: downgrades, the flow plan, how the batch lane sees a pool, who gives way."""

from __future__ import annotations

import pytest

from switchyard.decide.flow import (
    WAITING_SHARE,
    batch_pool_utilisation,
    batch_view,
    downgrade_target,
    preemption_victims,
)
from switchyard.policy import PolicySnapshot
from switchyard.policy.fleet import Pool


def test_downgrade_targets(four_classes: PolicySnapshot) -> None:
    large, small = four_classes.models["large"], four_classes.models["small"]
    assert downgrade_target(four_classes, large, "standard", 1000) is small
    assert downgrade_target(four_classes, large, "critical", 1000) is None  # not a class it downgrades
    assert downgrade_target(four_classes, large, "standard", 9000) is None  # small's window is 8192
    assert downgrade_target(four_classes, small, "standard", 10) is None  # no on_saturation


def test_preemption_takes_the_youngest_until_there_is_room_and_those_still_waiting() -> None:
    yielders = [(0.0, 100), (1.0, 100), (2.0, 100), (2.9, 100)]  # sent at, tokens; oldest first
    room_after = {0: True, 1: True, 2: False}  # full until two are gone
    victims = preemption_victims(yielders, lambda gone, _tokens: room_after.get(gone, False), None, 3.0)
    assert victims == [3, 2]
    # With a usual prefill of 1 s, one sent less than WAITING_SHARE of it ago waits for its first step: it goes too.
    assert WAITING_SHARE == 0.5
    young = preemption_victims(yielders, lambda gone, _tokens: False, 1.0, 3.0)
    assert young == [3]
    both = preemption_victims(yielders, lambda gone, tokens: gone == 0 or tokens < 100, 1.0, 3.0)
    assert both == [3]


def test_the_batch_lane_sees_prefills_as_full_and_keeps_the_reserved_slots() -> None:
    assert batch_view(0.2, 0, False) == 0.2
    assert batch_view(0.2, 1, False) == 1.0 and batch_view(1.5, 0, True) == 1.5
    pool = Pool(name="p", region="r", served_model="m", endpoints=["http://a", "http://b"], kv_cache_tokens=1000,
                max_num_seqs=2, batch_reserve_slots=1)
    assert batch_pool_utilisation(pool, [0.0, 1.0], 2) == pytest.approx(0.75)  # (2 taken + 1 kept) / 4
    greedy = Pool(name="p", region="r", served_model="m", endpoints=["http://a"], kv_cache_tokens=1000,
                  max_num_seqs=2, batch_reserve_slots=9)
    assert batch_pool_utilisation(greedy, [0.0], 0) == pytest.approx(0.5)  # never all the slots
    plain = Pool(name="p", region="r", served_model="m", endpoints=["http://a"], kv_cache_tokens=1000)
    assert batch_pool_utilisation(plain, [0.3], 5) == 0.3
