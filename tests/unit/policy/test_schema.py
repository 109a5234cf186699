"""The schema accepts what it should, and the shipped demo policy is valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyDocument, compile_policy, policy_sha256
from switchyard.policy.fleet import split_fallback
from switchyard.policy.units import _parse_duration
from tests.unit.policy.base import base, to_yaml

ROOT = Path(__file__).resolve().parents[3]


def test_demo_policy_is_realistic_and_valid() -> None:
    text = (ROOT / "policies.yaml").read_text()
    snapshot = compile_checked(text, "policies.yaml")
    doc = snapshot.document
    assert len(doc.regions) == 2
    assert {"small", "medium", "large"} <= set(snapshot.models)
    for model in ("small", "medium", "large"):
        regions = {snapshot.pools[p].region for p in snapshot.models[model].pools}
        assert regions == set(doc.regions), f"{model} must have pools in both regions"
    assert "auto" in snapshot.routes
    assert len(doc.tiers) == 3
    assert doc.tests, "the demo policy carries policy tests"


def test_base_document_compiles_to_indexed_snapshot() -> None:
    text = to_yaml(base())
    snapshot = compile_policy(text, "base.yaml", version=4)
    assert snapshot.label == "v4"
    assert snapshot.sha256 == policy_sha256(text)
    assert [p.name for p in snapshot.model_pools["small"]] == ["small-us", "small-eu"]
    assert snapshot.allowed(snapshot.tiers["pro"], "large")  # '*'
    assert not snapshot.allowed(snapshot.tiers["free"], "large")
    assert list(snapshot.priorities) == ["critical", "sheddable", "batch"], "order is best first"
    with pytest.raises(TypeError):
        snapshot.models["x"] = snapshot.models["small"]  # type: ignore[index]


def test_endpoints_are_normalised() -> None:
    doc = base()
    doc["pools"][0]["endpoints"][0] = "http://127.0.0.1:9001/"
    snapshot = compile_policy(to_yaml(doc))
    assert snapshot.pools["small-us"].endpoints[0] == "http://127.0.0.1:9001"


def test_documents_are_frozen() -> None:
    snapshot = compile_policy(to_yaml(base()))
    with pytest.raises(Exception, match="frozen"):
        snapshot.models["small"].context_window = 1  # type: ignore[misc]


@pytest.mark.parametrize(("value", "seconds"), [
    (90, 90.0), ("90", 90.0), ("250ms", 0.25), ("30s", 30.0), ("10m", 600.0), ("1h", 3600.0), ("1.5d", 129600.0),
])
def test_durations(value: object, seconds: float) -> None:
    assert _parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "10 minutes", "-5s", 0, True, "1w"])
def test_bad_durations(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        _parse_duration(value)


def test_split_fallback() -> None:
    assert split_fallback("large@eu-west") == ("large", "eu-west")
    assert split_fallback("medium") == ("medium", None)


def test_json_schema_export_names_every_section() -> None:
    schema = PolicyDocument.model_json_schema(by_alias=True)
    assert set(schema["properties"]) == {"schema", "regions", "pools", "models", "routes", "priorities",
                                         "tiers", "cache", "classifiers", "endpoint_profiles", "resilience", "tests",
                                         "rollout"}
    json.dumps(schema)  # serialisable
