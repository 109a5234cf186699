"""Flow control's pure decisions: downgrades, the flow plan, how the batch lane sees a pool, who gives way."""

from __future__ import annotations

import pytest

from switchyard.decide.flow import downgrade_target
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml


@pytest.fixture
def snapshot() -> PolicySnapshot:
    doc = base()
    doc["priorities"] = {
        "critical": {"max_queue_ms": 5000},
        "standard": {"max_queue_ms": 1500},
        "sheddable": {"max_queue_ms": 200, "shed_above_utilisation": 0.8},
        "batch": {"lane": "batch"},
    }
    doc["tiers"][1]["priority"] = "standard"  # pro
    doc["models"][1]["on_saturation"] = {"downgrade_to": "small", "classes": ["standard", "sheddable"]}
    return compile_policy(to_yaml(doc))




def test_downgrade_targets(snapshot: PolicySnapshot) -> None:
    large, small = snapshot.models["large"], snapshot.models["small"]
    assert downgrade_target(snapshot, large, "standard", 1000) is small
    assert downgrade_target(snapshot, large, "critical", 1000) is None  # not a class it downgrades
    assert downgrade_target(snapshot, large, "standard", 9000) is None  # small's window is 8192
    assert downgrade_target(snapshot, small, "standard", 10) is None  # no on_saturation
