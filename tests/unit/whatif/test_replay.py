"""The pre-publish replay: decisions as the gateway makes them, engines as the simulator models them."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.bench.prompts import LiteralText
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.policy import PolicySnapshot, compile_policy
from switchyard.simtext.chat import render_chat
from switchyard.whatif import compare_arms, render_report, replay_policy
from switchyard.whatif.fleet import Fleet, FleetError
from switchyard.whatif.outcomes import NOT_MODELLED
from tests.unit.policy.base import base, to_yaml


def snap(doc: dict[str, Any] | None = None, *, limits: bool = False) -> PolicySnapshot:
    """The test policy; without its tiers' limits unless ``limits`` (most tests are about routing)."""
    doc = doc or base()
    if not limits:
        for tier in doc["tiers"]:
            tier.pop("limits", None)
            tier.pop("model_limits", None)
    return compile_policy(to_yaml(doc))


def workload(rate: float = 4.0, duration: float = 20.0, seed: int = 1, **template: Any) -> Workload:
    mix = [RequestTemplate(**{"tenant": "pro", "model": "auto", "prompt_tokens": (150, 400),
                              "output_tokens": (8, 32), **template})]
    return poisson(rate, duration, mix, seed)


def one(index: int, arrival: float, prompt: str, *, tier: str = "pro", model: str = "small",
        max_tokens: int = 16) -> RequestSpec:
    return RequestSpec(index, arrival, LiteralText(prompt), max_tokens, Labels(tenant=tier, model=model))


def test_the_same_policy_twice_changes_nothing_and_is_deterministic() -> None:
    wl = workload()
    a = replay_policy(snap(), wl, name="active")
    b = replay_policy(snap(), wl)
    report = compare_arms(a, b, wl.describe())
    assert report["changes"]["any_changed"] == 0 and report["changes"]["moves"] == []
    base_arm, cand_arm = report["arms"]
    for key in ("served", "cost", "ttft_p50_s", "ttft_p99_s", "prefix_cache_hit_ratio"):
        assert base_arm[key] == cand_arm[key]
    assert base_arm["served"] == len(wl) > 50
    assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.e2e_s for o in a.outcomes)  # type: ignore[operator]


def test_a_route_change_moves_exactly_the_requests_it_should() -> None:
    wl = workload()  # prompts of 150..400 tokens: the base policy's auto sends them to large (default)
    doc = base()
    doc["routes"][0]["rules"][1]["when"] = {"prompt_tokens_lt": 100_000}  # now everything short goes small
    a, b = replay_policy(snap(), wl, name="active"), replay_policy(snap(doc), wl)
    assert {o.model for o in a.outcomes} == {"large"} and {o.model for o in b.outcomes} == {"small"}
    changes = compare_arms(a, b, wl.describe())["changes"]
    assert changes["model_changed"] == changes["pool_changed"] == changes["any_changed"] == len(wl)
    moved_to = {m["to"] for m in changes["moves"]}
    assert moved_to <= {"small @ small-us (us-east)", "small @ small-eu (eu-west)"}
    region = sum(1 for o in b.outcomes if o.region == "eu-west")
    assert changes["region_changed"] == region > 0  # large lives in us-east only; the picker spreads small


def test_cost_is_the_served_models_price_of_the_tokens_the_engine_saw() -> None:
    spec = one(0, 0.0, "hello there, how are you", max_tokens=20)
    arm = replay_policy(snap(), [spec])
    outcome = arm.outcomes[0]
    prompt = len(render_chat([{"role": "user", "content": "hello there, how are you"}]))
    assert (outcome.status, outcome.model, outcome.prompt_tokens, outcome.output_tokens) == (200, "small", prompt, 20)
    assert outcome.cost == pytest.approx((prompt * 0.1 + 20 * 0.2) / 1e6)  # (the price is decide.admit.spend_of)


def test_refusals_are_the_gateways_statuses_per_tier() -> None:
    wl = workload(tenant="free", model="large")  # free may not call large
    doc = base()
    doc["tiers"][0]["models"] = ["*"]
    del doc["priorities"]["sheddable"]["shed_above_utilisation"]  # flow control would shed a few
    a, b = replay_policy(snap(), wl, name="active"), replay_policy(snap(doc), wl)
    assert {(o.status, o.code) for o in a.outcomes} == {(403, "model_not_allowed")}
    assert {o.status for o in b.outcomes} == {200}
    report = compare_arms(a, b, wl.describe())
    [row] = report["refusals"]
    assert row["tier"] == "free" and row["class"] == "sheddable"
    assert (row["active_other"], row["candidate_other"]) == (len(wl), 0)
    assert report["arms"][0]["cost_per_1000"] == 0 < report["arms"][1]["cost_per_1000"]


def test_a_prompt_longer_than_the_context_window_is_the_engines_400() -> None:
    long = " word" * 9000  # more than small's 8192-token window
    arm = replay_policy(snap(), [one(0, 0.0, long)])
    assert (arm.outcomes[0].status, arm.outcomes[0].code) == (400, "context_length_exceeded")


def test_shared_prefixes_hit_the_prefix_cache_of_the_endpoint_the_picker_chose() -> None:
    shared = "You are a careful assistant. " * 120  # ~700 tokens, several KV blocks
    specs = [one(i, i * 2.0, shared + f"question number {i}?") for i in range(8)]
    arm = replay_policy(snap(), specs)
    assert len({o.endpoint for o in arm.outcomes}) == 1  # prefix affinity keeps them together
    assert all(o.cached_tokens >= 512 for o in arm.outcomes[1:]) and arm.outcomes[0].cached_tokens == 0
    spread = replay_policy(snap(), specs, strategy="round-robin")
    assert len({o.endpoint for o in spread.outcomes}) > 1
    assert sum(o.cached_tokens for o in spread.outcomes) < sum(o.cached_tokens for o in arm.outcomes)


def test_a_class_raised_in_priority_starts_sooner_under_overload() -> None:
    doc = base()
    doc["pools"][0]["endpoints"] = doc["pools"][0]["endpoints"][:1]
    doc["pools"][0]["kv_cache_tokens"] = 20000
    doc["models"][0]["pools"] = ["small-us"]
    doc["models"][0]["fallback"] = []
    doc["pools"][0]["priority_scheduling"] = True
    mix = [RequestTemplate(tenant="free", model="small", prompt_tokens=(900, 1100), output_tokens=(100, 200)),
           RequestTemplate(tenant="pro", model="small", prompt_tokens=(900, 1100), output_tokens=(100, 200))]
    wl = poisson(40.0, 10.0, mix, seed=3)  # far more than one engine with 20k tokens of KV can hold
    raised = doc | {"tiers": [dict(t, priority="critical" if t["name"] == "free" else "sheddable")
                              for t in doc["tiers"]]}
    # The engine's own priority scheduling, without the gateway's queues (which would shed sheddable).
    a = replay_policy(snap(doc), wl, name="active", flow_control=False)
    b = replay_policy(snap(raised), wl, flow_control=False)
    rows = {r["class"]: r for r in compare_arms(a, b, wl.describe())["ttft"]}
    # Under the active policy free is sheddable (runs last); the candidate swaps the classes.
    free_a = [o.ttft_s for o in a.outcomes if o.tier == "free"]
    free_b = [o.ttft_s for o in b.outcomes if o.tier == "free"]
    assert sum(free_b) < sum(free_a) / 2  # type: ignore[arg-type]
    assert rows["critical"]["active_p50"] < rows["sheddable"]["active_p50"]
    assert rows["critical"]["candidate_p50"] < rows["sheddable"]["candidate_p50"]
    # A pool without --scheduling-policy priority serves first come, first served: no difference.
    doc["pools"][0]["priority_scheduling"] = raised["pools"][0]["priority_scheduling"] = False
    fcfs_a, fcfs_b = (replay_policy(snap(doc), wl, flow_control=False),
                      replay_policy(snap(raised), wl, flow_control=False))
    assert [o.ttft_s for o in fcfs_a.outcomes] == [o.ttft_s for o in fcfs_b.outcomes]


def test_the_report_renders_what_the_data_says() -> None:
    wl = workload(duration=5.0)
    doc = base()
    doc["tiers"][1]["models"] = ["small"]  # pro may no longer call auto
    del doc["tiers"][1]["model_limits"]
    a, b = replay_policy(snap(), wl, name="active"), replay_policy(snap(doc), wl)
    report = compare_arms(a, b, wl.describe())
    text = render_report(report)
    assert f"**{len(wl)} of {len(wl)} requests change placement**" in text
    assert "refused 403 (model_not_allowed)" in text
    assert report["not_modelled"] == list(NOT_MODELLED) and "semantic cache rules" in text
    with pytest.raises(ValueError, match="different requests"):
        compare_arms(a, replay_policy(snap(), wl.specs[:3]), wl.describe())


def test_a_pool_that_cannot_be_simulated_is_named() -> None:
    doc = base()
    doc["pools"][2]["sim_profile"] = "no-such-profile"
    with pytest.raises(FleetError, match="pool large-us"):
        Fleet(snap(doc))


def test_admission_is_replayed_on_the_simulated_clock() -> None:
    # free: 1000 tokens a minute. Six requests of ~250 tokens in the first ten seconds: the bucket
    # (refilling 1000/60 a second) admits four, then refuses until it has refilled.
    specs = [one(i, i * 2.0, "hello " * 40, tier="free", model="small", max_tokens=200) for i in range(6)]
    specs.append(one(6, 70.0, "hello " * 40, tier="free", model="small", max_tokens=200))
    arm = replay_policy(snap(limits=True), specs)
    assert [o.status for o in arm.outcomes] == [200, 200, 200, 200, 429, 429, 200]
    assert arm.outcomes[4].code == "rate_limit_exceeded"
    doc = base()
    doc["tiers"][0]["limits"]["tokens_per_minute"] = 5000
    report = compare_arms(arm, replay_policy(snap(doc, limits=True), specs), {})
    (row,) = report["refusals"]
    assert (row["tier"], row["active_429"], row["candidate_429"]) == ("free", 2, 0)
    too_big = replay_policy(snap(limits=True), [one(0, 0.0, "hi", tier="free", model="small", max_tokens=2000)])
    assert (too_big.outcomes[0].status, too_big.outcomes[0].code) == (429, "request_too_large")
