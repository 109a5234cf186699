"""Allowed and home regions, sessions, and what the model decision's trace says about cost."""

from __future__ import annotations

import pytest

from switchyard.decide.dryrun import dry_run
from switchyard.decide.features import RequestFeatures
from switchyard.decide.plugins import compile_profile
from switchyard.decide.refusals import Refused
from switchyard.decide.regions import place
from switchyard.decide.resolve import NeedsScore, resolve_model
from switchyard.decide.sessions import session_key
from switchyard.policy import PolicyError, PolicySnapshot, compile_policy
from switchyard.policy.routing import BASELINE_PROFILES, DEFAULT_PROFILE
from tests.unit.policy.base import base, to_yaml


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    doc = base()
    doc["tiers"].append({"name": "eu-only", "priority": "critical", "models": ["*"], "regions": ["eu-west"]})
    return compile_policy(to_yaml(doc))


def test_the_header_wins_then_the_key_then_the_gateway(snapshot: PolicySnapshot) -> None:
    small = snapshot.models["small"]
    assert place(snapshot, "pro", small, None).home is None
    assert place(snapshot, "pro", small, None, None, "eu-west").home == "eu-west"
    assert place(snapshot, "pro", small, None, "us-east", "eu-west").home == "us-east"
    header = place(snapshot, "pro", small, "eu-west", "us-east", "us-east")
    assert (header.home, header.allowed) == ("eu-west", None)
    assert header.trace == "home region eu-west (from the header)"
    # A stored region the policy no longer declares is passed over, not an error.
    stale = place(snapshot, "pro", small, None, "ap-south", "us-east")
    assert stale.home == "us-east" and "key or tenant region ap-south passed over (not in the policy)" in stale.trace


def test_a_tier_with_regions_is_served_only_there(snapshot: PolicySnapshot) -> None:
    small, large = snapshot.models["small"], snapshot.models["large"]
    eu = place(snapshot, "eu-only", small, None, "us-east")
    assert eu.allowed == frozenset({"eu-west"}) and eu.home is None
    assert "key or tenant region us-east passed over (not allowed for the tier)" in eu.trace
    with pytest.raises(Refused) as refused:
        place(snapshot, "eu-only", small, "us-east")
    assert (refused.value.status, refused.value.code) == (403, "region_not_allowed")
    with pytest.raises(Refused) as refused:
        place(snapshot, "eu-only", large, None)
    assert refused.value.status == 403 and "has no pool there" in refused.value.message
    with pytest.raises(Refused) as refused:
        place(snapshot, "pro", small, "mars")
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_region",
                                                                                "x-switchyard-region")


def test_dry_runs_follow_regions(snapshot: PolicySnapshot) -> None:
    def run(tier: str, model: str, **headers: str) -> tuple[int, str | None]:
        result = dry_run(snapshot, tier, RequestFeatures(model=model, prompt_tokens=10, headers=headers))
        return result.status, result.pool

    assert run("pro", "small") == (200, "small-us")
    assert run("pro", "small", **{"x-switchyard-region": "eu-west"}) == (200, "small-eu")
    assert run("eu-only", "small") == (200, "small-eu")
    assert run("eu-only", "large") == (403, None)
    assert run("pro", "small", **{"x-switchyard-region": "moon"}) == (400, None)


def test_unknown_tier_regions_are_rejected() -> None:
    doc = base()
    doc["tiers"][0]["regions"] = ["eu-wset"]
    with pytest.raises(PolicyError, match=r"tiers\[free\].regions\[0\]: unknown region 'eu-wset'; did you mean"):
        compile_policy(to_yaml(doc))


def test_session_keys_come_from_the_header_or_the_user_field() -> None:
    assert session_key("x-session-id", True, {"x-session-id": "abc"}, {"user": "u"}, "7", "small") == \
        "7\x00small\x00abc"
    assert session_key("x-session-id", True, {}, {"user": "u"}, "7", "small") == "7\x00small\x00u"
    assert session_key("x-session-id", False, {}, {"user": "u"}, "7", "small") is None
    assert session_key("x-session-id", True, {}, {"user": 5}, "7", "small") is None
    assert session_key("x-session-id", True, {}, {}, "7", "small") is None
    assert len(session_key("x-session-id", True, {"x-session-id": "x" * 10_000}, {}, "7", "m") or "") < 300
    # Only a profile with session affinity keeps sessions: its scorer is the one stateful plugin that does.
    assert [type(o).__name__ for o in compile_profile("d", DEFAULT_PROFILE).observers] == [
        "PrefixAffinityScorer", "SessionAffinityScorer"]
    assert compile_profile("l", BASELINE_PROFILES["least-loaded"]).observers == ()


def test_route_decisions_trace_the_cost_against_the_most_expensive_choice() -> None:
    snapshot = compile_policy(to_yaml(base()))
    decision = resolve_model(snapshot, "pro", RequestFeatures(model="auto", prompt_tokens=50, max_tokens=100))
    assert decision.model.name == "small"
    # small: 50 x 0.1 + 100 x 0.2 per M = 0.000025; large: 50 x 1 + 100 x 3 per M = 0.00035.
    assert decision.trace[-1] == ("route auto: rule short matched → small; est. cost 0.000025 vs 0.000350 on large "
                                  "(-93%)")
    doc = base()
    doc["routes"][0]["compare_to"] = "small"
    other = resolve_model(compile_policy(to_yaml(doc)), "pro", RequestFeatures(model="auto", prompt_tokens=500))
    assert other.model.name == "large" and "on small (+" in other.trace[-1]


def test_classifiers_that_call_out_are_asked_for_and_offline_they_do_not_match() -> None:
    doc = base()
    doc["pools"].append({"name": "embed-us", "region": "us-east", "served_model": "e5", "task": "embed",
                         "endpoints": ["http://127.0.0.1:9009"], "kv_cache_tokens": 10000})
    doc["classifiers"] = {"legal": {"type": "embedding", "pool": "embed-us",
                                    "examples": {"positive": ["contract law"], "negative": ["hello"]}}}
    doc["routes"][0]["rules"].insert(0, {"name": "legal", "when": {"classifier": "legal"}, "model": "large"})
    snapshot = compile_policy(to_yaml(doc))
    features = RequestFeatures(model="auto", prompt_tokens=10, last_user_text="a tort")
    with pytest.raises(NeedsScore) as needs:
        resolve_model(snapshot, "pro", features)
    assert needs.value.name == "legal"
    assert resolve_model(snapshot, "pro", features, {"legal": 0.7}).rule == "legal"
    assert resolve_model(snapshot, "pro", features, {"legal": 0.3}).rule == "short"
    offline = dry_run(snapshot, "pro", features)  # a dry run has no embeddings: the classifier is unavailable
    assert offline.model == "small" and offline.trace[0] == "classifier legal (embedding): unavailable, rule skipped"


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["routes"][0]["rules"][0]["when"].update(classifier="hrad"), "unknown classifier 'hrad'"),
    (lambda d: d.update(classifiers={"x": {"type": "embedding", "pool": "small-us",
                                           "examples": {"positive": ["a"], "negative": ["b"]}}}),
     "pool 'small-us' does not serve embeddings"),
    (lambda d: d["pools"][0].update(task="embed"), "pool 'small-us' serves embeddings"),
    (lambda d: d["routes"][0].update(compare_to="huge"), "unknown model 'huge'"),
])
def test_bad_classifier_references(change: object, message: str) -> None:
    doc = base()
    change(doc)  # type: ignore[operator]
    with pytest.raises(PolicyError, match=message):
        compile_policy(to_yaml(doc))
