"""A canary in the replay: its candidate decides the requests of the slice (the gateway's own hash, salted by the
canary's id) and the active version the rest; the report says how many the candidate decided."""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from switchyard.bench.prompts import LiteralText
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.decide import canary as rules
from switchyard.decide.decision import Caller
from switchyard.policy.rollout import Rollout, rollout_from_flags
from switchyard.whatif import CanarySlice, ReplayCanary, Who, compare_arms, render_report, replay_policy, replay_report
from switchyard.whatif.logged import LogEntry, log_who, log_workload
from tests.unit.policy.base import base
from tests.unit.whatif.test_replay import snap

#: Long enough that the base policy's ``auto`` sends it to ``large`` (its ``short`` rule takes under 100 tokens).
LONG = "tell me about the weather in the mountains this week, " * 12


def _to_small() -> dict[str, Any]:
    """The base policy with ``auto``'s default at ``small``: a request the candidate decides is served by small."""
    doc = base()
    doc["routes"][0]["default"] = "small"
    return doc


ACTIVE, CANDIDATE = snap(), snap(_to_small())


def _specs(tenants: int, per_tenant: int, *, tiers: tuple[str, ...] = ("pro",), model: str = "auto",
           session: bool = False) -> tuple[list[RequestSpec], dict[str, Caller]]:
    """``per_tenant`` requests from each of ``tenants`` tenants (their tiers in turn), interleaved, a request every
    50 ms; and who each tenant label is."""
    specs, callers = [], {}
    for t in range(tenants):
        callers[f"t{t}"] = Caller(tiers[t % len(tiers)], f"tenant-{t}", f"key-{t}")
    for i in range(tenants * per_tenant):
        t = i % tenants
        headers = {"X-Session-Id": f"s{i % 7}"} if session else {}
        specs.append(RequestSpec(i, i * 0.05, LiteralText(LONG + str(i)), 8,
                                 Labels(tenant=f"t{t}", model=model, stream=False, headers=headers)))
    return specs, callers


def _canary(rollout: Rollout, percent: float | None = None, salt: int = 7) -> ReplayCanary:
    return ReplayCanary(CANDIDATE, CanarySlice.of(rollout, salt, percent))


def test_the_candidate_decides_the_slices_share_and_the_active_version_the_rest() -> None:
    specs, callers = _specs(200, 2)
    arm = replay_policy(ACTIVE, specs, callers=callers, canary=_canary(Rollout(percent=30, by="request")))
    roles = Counter(o.canary for o in arm.outcomes)
    assert set(roles) == {"canary", "control"}
    assert abs(roles["canary"] / len(specs) - 0.30) < 0.07
    # Exactly the requests the gateway's own functions put in the slice (salted with the canary's id).
    expected = {s.index for s in specs if rules.in_slice(7, 30, rules.subject_of("request", "", "", None,
                                                                                  f"replay-{s.index}"))}
    assert {o.index for o in arm.outcomes if o.canary == "canary"} == expected
    # Each side was decided by its own version: the candidate's default is small, the active version's large.
    assert {o.model for o in arm.outcomes if o.canary == "canary"} == {"small"}
    assert {o.model for o in arm.outcomes if o.canary == "control"} == {"large"}
    assert arm.policy == f"{CANDIDATE.label} canary (30% by request)" and arm.sha256 == CANDIDATE.sha256
    assert arm.canary is not None and arm.canary["percent"] == 30 and arm.canary["salt"] == 7


def test_by_tenant_keeps_each_tenants_requests_on_one_side() -> None:
    specs, callers = _specs(60, 5)
    arm = replay_policy(ACTIVE, specs, callers=callers, canary=_canary(Rollout(percent=40, by="tenant")))
    sides: dict[str, set[str | None]] = defaultdict(set)
    for o in arm.outcomes:
        sides[o.tier].add(o.canary)
    assert all(len(side) == 1 for side in sides.values())
    inside = {label for label, side in sides.items() if side == {"canary"}}
    assert inside == {f"t{t}" for t in range(60) if rules.in_slice(7, 40, f"t:tenant-{t}")}
    assert 0 < len(inside) < 60
    # Another canary (another salt) takes another slice of the same tenants.
    other = replay_policy(ACTIVE, specs, callers=callers, canary=_canary(Rollout(percent=40, by="tenant"), salt=8))
    assert {o.tier for o in other.outcomes if o.canary == "canary"} != inside


def test_by_key_and_by_session_hash_what_the_gateway_hashes() -> None:
    specs, callers = _specs(40, 3, session=True)
    by_key = replay_policy(ACTIVE, specs, callers=callers, canary=_canary(Rollout(percent=50, by="key")))
    assert {o.index for o in by_key.outcomes if o.canary == "canary"} == {
        s.index for s in specs if rules.in_slice(7, 50, f"k:{callers[s.tenant].key}")}
    by_session = replay_policy(ACTIVE, specs, callers=callers, canary=_canary(Rollout(percent=50, by="session")))
    assert {o.index for o in by_session.outcomes if o.canary == "canary"} == {
        s.index for s in specs
        if rules.in_slice(7, 50, f"s:{callers[s.tenant].tenant}:{s.labels.headers['X-Session-Id']}")}


def test_requests_outside_the_scope_are_never_the_candidates() -> None:
    specs, callers = _specs(80, 2, tiers=("pro", "free"))
    arm = replay_policy(ACTIVE, specs, callers=callers,
                        canary=_canary(rollout_from_flags(percent=60, by="request", tiers=["pro"])))
    free = [o for o in arm.outcomes if callers[o.tier].tier == "free"]
    pro = [o for o in arm.outcomes if callers[o.tier].tier == "pro"]
    assert free and all(o.canary is None for o in free)
    assert {o.canary for o in pro} == {"canary", "control"}
    # A scope of models: a request for small (the model asked for) is outside a canary of auto.
    mixed = [*specs[:40], *_specs(40, 1, model="small")[0]]
    mixed = [RequestSpec(i, i * 0.05, s.prompt, s.max_tokens, s.labels) for i, s in enumerate(mixed)]
    by_model = replay_policy(ACTIVE, mixed, callers=callers,
                             canary=_canary(rollout_from_flags(percent=60, by="request", models=["auto"])))
    assert all(o.canary is None for o in by_model.outcomes if o.requested == "small")
    # A scope of regions: the gateway's region (the replay's, or the slice's own) decides.
    regional = _canary(rollout_from_flags(percent=60, by="request", regions=["eu-west"]))
    assert all(o.canary is None for o in replay_policy(ACTIVE, specs[:20], callers=callers, canary=regional,
                                                         gateway_region="us-east").outcomes)
    assert any(o.canary == "canary" for o in replay_policy(ACTIVE, specs[:20], callers=callers, canary=regional,
                                                             gateway_region="eu-west").outcomes)


def test_a_candidate_like_the_active_version_changes_nothing() -> None:
    specs, callers = _specs(50, 2)
    same = ReplayCanary(ACTIVE, CanarySlice(Rollout(percent=50, by="request"), 50, 3))
    a = replay_policy(ACTIVE, specs, callers=callers, name="active")
    b = replay_policy(ACTIVE, specs, callers=callers, canary=same)
    assert [o.placement for o in a.outcomes] == [o.placement for o in b.outcomes]
    assert [o.ttft_s for o in a.outcomes] == [o.ttft_s for o in b.outcomes]


def test_a_pool_only_the_candidate_names_is_simulated_for_its_slice() -> None:
    doc = _to_small()
    doc["pools"].append({"name": "small-new", "region": "us-east", "served_model": "llama-8b",
                         "endpoints": ["http://127.0.0.1:9009"], "kv_cache_tokens": 100000})
    doc["models"][0]["pools"] = ["small-new"]
    doc["models"][0]["fallback"] = []
    candidate = snap(doc)
    specs, callers = _specs(40, 2)
    arm = replay_policy(ACTIVE, specs, callers=callers,
                        canary=ReplayCanary(candidate, CanarySlice(Rollout(percent=50, by="request"), 50)))
    assert {o.pool for o in arm.outcomes if o.canary == "canary"} == {"small-new"}
    assert {o.pool for o in arm.outcomes if o.canary == "control"} == {"large-us"}
    assert all(o.status == 200 for o in arm.outcomes)


def test_the_report_says_how_many_requests_the_candidate_decided() -> None:
    specs, callers = _specs(100, 2)
    wl = Workload(tuple(specs), specs[-1].arrival_s, {"source": "test"})
    base_arm = replay_policy(ACTIVE, wl, callers=callers, name="active")
    arm = replay_policy(ACTIVE, wl, callers=callers, name="canary", canary=_canary(Rollout(percent=25,
                                                                                           by="request")))
    report = compare_arms(base_arm, arm, wl.describe())
    canary = report["canary"]
    decided = sum(1 for o in arm.outcomes if o.canary == "canary")
    assert (canary["requests"], canary["in_scope"], canary["candidate_decided"]) == (200, 200, decided)
    assert canary["share"] == pytest.approx(decided / 200) and canary["by"] == "request"
    assert canary["candidate"] == CANDIDATE.label and canary["only"] == {"tiers": [], "regions": [], "models": []}
    # The whole comparison sees exactly the slice move from large to small; the slice's own figures, too.
    assert report["changes"]["model_changed"] == decided == canary["slice"]["changes"]["model_changed"]
    assert canary["slice"]["arms"][0]["requests"] == canary["slice"]["arms"][1]["requests"] == decided
    text = render_report(report)
    assert f"**{CANDIDATE.label} decided {decided} of 200 requests**" in text
    assert "the slice of 25% by request (salted with 7) of the 200 requests in the canary's scope" in text
    assert "### The slice alone" in text
    assert "canary" not in compare_arms(base_arm, replay_policy(CANDIDATE, wl, callers=callers), {})
    # replay_report replays the canary in its second arm when given a slice.
    whole = replay_report(ACTIVE, CANDIDATE, wl, canary=CanarySlice(Rollout(percent=25, by="request"), 25, 7))
    assert whole["arms"][1]["name"] == "canary" and whole["canary"]["percent"] == 25


# --- the request log: the slice the gateway took ----------------------------------------------------

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_a_logged_request_is_hashed_by_its_tenant_key_and_id_as_the_gateway_did() -> None:
    entries = [LogEntry(at=T0 + timedelta(seconds=i * 0.2), kind="chat", tier="pro", model="auto", stream=False,
                        status=200, prompt_tokens=300, completion_tokens=8, tenant_id=i % 30, key_id=100 + i % 30,
                        request_id=f"req-{i}") for i in range(120)]
    entries.insert(5, LogEntry(at=T0, kind="chat", tier=None, model="auto", stream=False, status=401,
                               prompt_tokens=None))  # not replayed: the indices of the others stay aligned
    wl, who = log_workload(entries), log_who(entries)
    assert len(wl.specs) == len(who) == 120
    assert who[3] == Who("3", "103", "req-3")
    arm = replay_policy(ACTIVE, wl, who=who, canary=_canary(Rollout(percent=50, by="tenant")))
    by_tenant: dict[str, set[str | None]] = defaultdict(set)
    for o in arm.outcomes:
        by_tenant[who[o.index].tenant or ""].add(o.canary)
    assert all(len(side) == 1 for side in by_tenant.values())  # every tier shares one label: the ids decide
    assert {t for t, side in by_tenant.items() if side == {"canary"}} == {
        str(t) for t in range(30) if rules.in_slice(7, 50, f"t:{t}")}
    by_request = replay_policy(ACTIVE, wl, who=who, canary=_canary(Rollout(percent=50, by="request")))
    assert {o.index for o in by_request.outcomes if o.canary == "canary"} == {
        i for i in range(120) if rules.in_slice(7, 50, f"r:req-{i}")}
