"""The replay's flow control and response cache: the gateway's queues, sheds, downgrades and cache hits."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from switchyard.bench.prompts import LiteralText
from switchyard.bench.spec import Labels, RequestSpec
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.whatif import compare_arms, render_report, replay_policy
from switchyard.whatif.replay import FLOW_TICK_S, HIT_S
from tests.unit.policy.base import base
from tests.unit.whatif.test_replay import snap


def one_pool(**priorities: Any) -> dict[str, Any]:
    """``small`` on one endpoint of 20k KV tokens, no fallback: easy to saturate."""
    doc = base()
    doc["pools"][0]["endpoints"] = doc["pools"][0]["endpoints"][:1]
    doc["pools"][0]["kv_cache_tokens"] = 20000
    doc["models"][0]["pools"] = ["small-us"]
    doc["models"][0]["fallback"] = []
    doc["priorities"].update(priorities)
    return doc


def overload(seed: int = 3) -> Any:
    mix = [RequestTemplate(tenant="free", model="small", prompt_tokens=(900, 1100), output_tokens=(100, 200)),
           RequestTemplate(tenant="pro", model="small", prompt_tokens=(900, 1100), output_tokens=(100, 200))]
    return poisson(30.0, 10.0, mix, seed=seed)


def test_overload_sheds_the_sheddable_class_and_queues_the_critical_one_within_its_deadline() -> None:
    doc = one_pool()
    wl = overload()
    arm = replay_policy(snap(doc), wl)
    codes = Counter((o.tier, o.status, o.code) for o in arm.outcomes)
    free = [o for o in arm.outcomes if o.tier == "free"]
    pro = [o for o in arm.outcomes if o.tier == "pro"]
    # sheddable (free): refused at once above 0.8 utilisation, or after its 200 ms queue deadline
    assert codes[("free", 503, "shed_utilisation")] > 0
    assert all(o.status in (200, 503) for o in free)
    # critical (pro): may wait 5 s; whoever waited was served or failed at the deadline
    queued = [o for o in pro if o.queued_s is not None]
    assert queued and all(o.queued_s <= 5.0 + FLOW_TICK_S for o in queued)  # type: ignore[operator]
    for o in arm.outcomes:
        if o.code == "queue_deadline_exceeded":
            deadline = 0.2 if o.tier == "free" else 5.0
            assert o.queued_s == pytest.approx(deadline, abs=FLOW_TICK_S + 1e-9)
        if o.status == 200 and o.queued_s is not None:
            assert o.ttft_s is not None and o.ttft_s >= o.queued_s
    # The served pro requests start faster than free's, and far faster than with no queues at all.
    served_pro = sum(1 for o in pro if o.status == 200)
    served_free = sum(1 for o in free if o.status == 200)
    assert served_pro / len(pro) > served_free / len(free)
    raw = replay_policy(snap(doc), wl, flow_control=False)
    assert {o.status for o in raw.outcomes} == {200}  # no queues: every request reaches the engine...
    p99 = sorted(o.ttft_s for o in raw.outcomes if o.tier == "pro")[-2]  # type: ignore[type-var]
    flowed = sorted(o.ttft_s for o in pro if o.ttft_s is not None)[-2]  # type: ignore[type-var]
    assert flowed < p99  # ...and the critical tier waits behind everybody


def test_the_report_counts_sheds_queues_and_codes() -> None:
    wl = overload()
    relaxed = one_pool(sheddable={"max_queue_ms": 200})  # no utilisation threshold: only queue deadlines
    a, b = replay_policy(snap(one_pool()), wl, name="active"), replay_policy(snap(relaxed), wl)
    report = compare_arms(a, b, wl.describe())
    arm_a, arm_b = report["arms"]
    for arm, result in ((arm_a, a), (arm_b, b)):
        shed = [o for o in result.outcomes if o.status == 503]
        assert arm["shed"] == len(shed) == sum(arm["codes"].get(c, 0) for c in (
            "shed_utilisation", "queue_wait_too_long", "queue_deadline_exceeded"))
        assert arm["queued"] == sum(1 for o in result.outcomes if o.queued_s is not None)
    assert arm_a["codes"].get("shed_utilisation", 0) > 0 and "shed_utilisation" not in arm_b["codes"]
    text = render_report(report)
    assert "| shed by flow control (503) |" in text and "## Error codes" in text and "| shed_utilisation |" in text


def test_a_saturated_model_downgrades_the_classes_its_rule_names() -> None:
    doc = one_pool(sheddable={"max_queue_ms": 200})
    doc["models"][0]["on_saturation"] = {"downgrade_to": "large", "classes": ["sheddable"]}
    doc["models"][1]["context_window"] = 32768
    arm = replay_policy(snap(doc), overload())
    down = [o for o in arm.outcomes if o.downgraded_from is not None]
    assert down and all(o.tier == "free" and o.downgraded_from == "small" and o.model == "large"
                        and o.pool == "large-us" for o in down)
    assert not any(o.downgraded_from for o in arm.outcomes if o.tier == "pro")
    assert compare_arms(arm, arm, {})["arms"][0]["downgraded"] == len([o for o in down if o.status == 200])


def ask(index: int, at: float, prompt: str, *, tier: str = "pro", temperature: float | None = 0.0) -> RequestSpec:
    extra = {} if temperature is None else {"temperature": temperature}
    return RequestSpec(index, at, LiteralText(prompt), 16, Labels(tenant=tier, model="small", extra_body=extra))


def test_an_identical_deterministic_request_is_a_response_cache_hit_until_the_entry_expires() -> None:
    doc = base()
    doc["cache"] = [{"match": {"models": ["small"]}, "mode": "exact", "ttl": "30s"}]
    specs = [ask(0, 0.0, "what is the capital of France?"),
             ask(1, 5.0, "what is the capital of France?"),   # hit
             ask(2, 6.0, "what is the capital of Spain?"),    # another question: miss
             ask(3, 7.0, "what is the capital of France?", tier="free"),  # tenant-scoped: free has no entry
             ask(4, 8.0, "what is the capital of France?", temperature=None),  # not deterministic: no rule
             ask(5, 40.0, "what is the capital of France?")]  # stored at ~0.1 s, expired at ~30.1 s
    arm = replay_policy(snap(doc), specs)
    hits = [o.index for o in arm.outcomes if o.cache_hit]
    assert hits == [1]
    hit, first = arm.outcomes[1], arm.outcomes[0]
    assert (hit.status, hit.model, hit.pool, hit.region, hit.placement) == (200, "small", "cache", None,
                                                                            "small @ response cache")
    assert hit.ttft_s == hit.e2e_s == HIT_S and hit.cost == 0.0
    assert (hit.prompt_tokens, hit.cached_tokens, hit.output_tokens) == (first.prompt_tokens, first.prompt_tokens,
                                                                         first.output_tokens)
    summary = compare_arms(arm, arm, {})["arms"][0]
    assert summary["cache_hits"] == 1 and summary["response_cache_hit_ratio"] == pytest.approx(1 / 6)
    no_cache = base()
    no_cache["cache"] = []
    assert not any(o.cache_hit for o in replay_policy(snap(no_cache), specs).outcomes)


def test_a_hit_charge_spends_the_tiers_limits() -> None:
    doc = base()
    doc["cache"] = [{"match": {"models": ["small"]}, "mode": "exact", "ttl": "10m", "hit_charge": 1.0}]
    doc["tiers"][1]["limits"] = {"tokens_per_minute": 100}
    prompt = "tell me a story " * 10  # ~40 prompt tokens + 16 output per request (+ the chat template)
    arm = replay_policy(snap(doc, limits=True), [ask(i, i * 1.0, prompt) for i in range(4)])
    statuses = [(o.status, o.cache_hit) for o in arm.outcomes]
    assert statuses[0] == (200, False) and statuses[1] == (429, False)  # a full-price hit no longer fits
    free = base()
    free["cache"] = [{"match": {"models": ["small"]}, "mode": "exact", "ttl": "10m"}]
    free["tiers"][1]["limits"] = {"tokens_per_minute": 100}
    arm = replay_policy(snap(free, limits=True), [ask(i, i * 1.0, prompt) for i in range(4)])
    assert [(o.status, o.cache_hit) for o in arm.outcomes] == [(200, False)] + [(200, True)] * 3


def test_a_short_deadline_fails_requests_at_it_or_at_once_when_the_predicted_wait_is_longer() -> None:
    arm = replay_policy(snap(one_pool(critical={"max_queue_ms": 300})), overload())
    codes = Counter(o.code for o in arm.outcomes if o.tier == "pro")
    assert codes["queue_deadline_exceeded"] > 0 and codes["queue_wait_too_long"] > 0
    for o in arm.outcomes:
        if o.code == "queue_deadline_exceeded":
            assert o.queued_s == pytest.approx(0.3, abs=1e-9)
        if o.code == "queue_wait_too_long":
            assert o.queued_s is None  # refused before it queued
        if o.status == 200 and o.queued_s is not None:
            assert o.queued_s <= 0.3
