"""Fixtures the decision tests share."""

from __future__ import annotations

import pytest

from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml


@pytest.fixture
def four_classes() -> PolicySnapshot:
    """The base policy with four classes (critical, standard, sheddable, batch), pro in standard, and large
    downgrading its standard and sheddable requests to small."""
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
