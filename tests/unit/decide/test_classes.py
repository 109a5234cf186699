"""A request's priority class: its tier's, lowered (never raised) by a header or the body's priority."""

from __future__ import annotations

import pytest

from switchyard.decide.classes import BadPriority, classify
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml


def test_the_class_comes_from_the_tier_with_default_engine_priorities(four_classes: PolicySnapshot) -> None:
    assert dict(four_classes.engine_priority) == {"critical": 0, "standard": 10, "sheddable": 20, "batch": 1030}
    cls = classify(four_classes, "pro", None, None)
    assert (cls.name, cls.rank, cls.engine_priority, cls.tier_class) == ("standard", 1, 10, "standard")
    assert cls.trace == "class standard (tier pro)"


def test_a_request_may_lower_its_class_by_header_or_body(four_classes: PolicySnapshot) -> None:
    by_header = classify(four_classes, "pro", "sheddable", None)
    assert (by_header.name, by_header.engine_priority) == ("sheddable", 20)
    assert "lowered by the x-switchyard-priority header" in by_header.trace
    by_name = classify(four_classes, "pro", None, "batch")
    assert (by_name.name, by_name.cls.lane, by_name.engine_priority) == ("batch", "batch", 1030)
    # A number in vLLM's sense: the last class at or below it; the engine gets the number itself.
    by_number = classify(four_classes, "pro", None, 25)
    assert (by_number.name, by_number.engine_priority) == ("sheddable", 25)
    # Both given: the lower one wins.
    both = classify(four_classes, "pro", "sheddable", "batch")
    assert both.name == "batch"


def test_a_request_can_never_raise_its_class(four_classes: PolicySnapshot) -> None:
    cls = classify(four_classes, "free", "critical", None)
    assert (cls.name, cls.engine_priority) == ("sheddable", 20)
    assert "above the tier's class" in cls.trace
    assert classify(four_classes, "free", None, -5).engine_priority == 20
    assert classify(four_classes, "free", None, 0).name == "sheddable"


@pytest.mark.parametrize(("header", "asked", "param"), [
    ("urgent", None, "x-switchyard-priority"),
    (None, "urgent", "priority"),
    (None, 1.5, "priority"),
    (None, True, "priority"),
])
def test_unknown_priorities_are_refused(four_classes: PolicySnapshot, header: str | None, asked: object,
                                        param: str) -> None:
    with pytest.raises(BadPriority) as caught:
        classify(four_classes, "pro", header, asked)
    assert caught.value.param == param


def test_explicit_engine_priorities_are_kept() -> None:
    doc = base()
    doc["priorities"]["batch"]["engine_priority"] = 100
    snapshot = compile_policy(to_yaml(doc))
    assert dict(snapshot.engine_priority) == {"critical": 0, "sheddable": 10, "batch": 100}
