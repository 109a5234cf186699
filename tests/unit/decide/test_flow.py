"""Flow control's pure decisions: downgrades, the flow plan, how the batch lane sees a pool, who gives way."""

from __future__ import annotations

import pytest

from switchyard.decide.classes import classify
from switchyard.decide.flow import (
    WAITING_SHARE,
    FlowDecision,
    batch_pool_utilisation,
    batch_view,
    downgrade_target,
    plan_flow,
    preemption_victims,
)
from switchyard.policy import PolicyError, PolicySnapshot, compile_policy
from switchyard.policy.fleet import Pool
from tests.unit.policy.base import to_yaml


def test_downgrade_targets(four_classes: PolicySnapshot) -> None:
    large, small = four_classes.models["large"], four_classes.models["small"]
    assert downgrade_target(four_classes, large, "standard", 1000) is small
    assert downgrade_target(four_classes, large, "critical", 1000) is None  # not a class it downgrades
    assert downgrade_target(four_classes, large, "standard", 9000) is None  # small's window is 8192
    assert downgrade_target(four_classes, small, "standard", 10) is None  # no on_saturation


def test_a_list_of_downgrade_rules_gives_classes_rules_of_their_own(four_classes: PolicySnapshot) -> None:
    doc = four_classes.document.model_dump(mode="json", exclude_none=True)
    doc["models"][1]["on_saturation"] = [
        {"downgrade_to": "small", "classes": ["standard", "sheddable"], "at_utilisation": 0.75},
        # (standard: the first rule applies)
        {"downgrade_to": "small", "classes": ["critical", "standard"], "wait_for_either": True},
    ]
    doc["tiers"] = [{"name": c, "priority": c, "models": ["*"]} for c in ("critical", "standard", "sheddable")]
    doc["tests"] = []
    snapshot = compile_policy(to_yaml(doc))
    large, small = snapshot.models["large"], snapshot.models["small"]
    assert [r.at_utilisation for r in large.saturation_rules] == [0.75, 1.0]
    assert large.saturation_rule("standard") is large.saturation_rules[0]
    assert large.saturation_rule("critical") is large.saturation_rules[1]
    assert large.saturation_rule("batch") is None and small.saturation_rules == ()
    assert downgrade_target(snapshot, large, "critical", 1000) is small

    def plan(klass: str, u: dict[str, float]) -> FlowDecision:
        return plan_flow(snapshot, large, classify(snapshot, klass, None, None), 1000, None,
                         lambda pool, _lane: u[snapshot.pools[pool.name].served_model], lambda _pool: _EMPTY)

    # Large three-quarters full, small idle: standard leaves large's last quarter to critical; critical takes it.
    served = {snapshot.pools[large.pools[0]].served_model: 0.75, snapshot.pools[small.pools[0]].served_model: 0.0}
    early = plan("standard", served)
    assert (early.action, early.model.name, early.reason) == ("downgrade", "small", "headroom")
    assert plan("critical", served).action == "go"
    # Both saturated: critical (wait_for_either) waits for large and for small, whichever frees first; standard
    # waits for large only.
    full = dict.fromkeys(served, 1.0)
    waits = plan("critical", full)
    assert waits.action == "queue" and waits.also is not None and waits.also[0] is small
    own = plan("standard", full)
    assert own.action == "queue" and own.also is None


def test_a_rule_naming_an_unknown_class_or_model_is_refused_at_its_place(four_classes: PolicySnapshot) -> None:
    doc = four_classes.document.model_dump(mode="json", exclude_none=True)
    doc["models"][1]["on_saturation"] = [{"downgrade_to": "small", "classes": ["standard"]},
                                         {"downgrade_to": "nowhere", "classes": ["gold"]}]
    with pytest.raises(PolicyError) as caught:
        compile_policy(to_yaml(doc))
    text = str(caught.value)
    assert "models[large].on_saturation[1].downgrade_to" in text and "nowhere" in text
    assert "models[large].on_saturation[1].classes[0]" in text and "gold" in text


class _Empty:
    def has_room(self, lane: str, u: float, ceiling: float) -> bool:
        return u < ceiling

    def saturated(self, lane: str, u: float, ceiling: float) -> bool:
        return u >= ceiling


_EMPTY = _Empty()


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
