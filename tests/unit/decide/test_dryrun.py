"""The dry-run evaluator and the policy tests that ask it."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.decide.dryrun import dry_run
from switchyard.decide.features import RequestFeatures
from switchyard.decide.policy_tests import compile_checked, run_policy_tests
from switchyard.policy import PolicyError, compile_policy
from tests.unit.policy.base import base, to_yaml


def with_tests(*tests: dict[str, Any]) -> str:
    doc = base()
    doc["tests"] = list(tests)
    return to_yaml(doc)


def test_a_dry_run_follows_every_stage_of_the_gateways_decisions() -> None:
    snapshot = compile_policy(to_yaml(base()))
    run = dry_run(snapshot, "pro", RequestFeatures(model="auto", prompt_tokens=300, max_tokens=100))
    assert (run.status, run.model, run.pool, run.region) == (200, "large", "large-us", "us-east")
    assert run.trace[0].startswith("route auto: no rule matched → default large; est. cost ")
    # The plan says where the request would go if its engine failed, and when it would move on; then the pick.
    assert run.trace[-2].startswith("fallback plan: large (large-us) → small (small-us, small-eu); at most 3 attempts")
    assert "nothing produced within 15 s (class critical's first-token deadline)" in run.trace[-2]
    assert run.trace[-1].startswith("endpoint http://127.0.0.1:9004 of pool large-us")
    assert run.plan == ("large", "small") and run.served_model == "large"
    refused = dry_run(snapshot, "free", RequestFeatures(model="large", prompt_tokens=5))
    assert (refused.status, refused.code, refused.model, refused.pool) == (403, "model_not_allowed", None, None)
    # A fallback stage whose window cannot hold the request is left out, and the trace says so.
    doc = base()
    del doc["tiers"][1]["model_limits"]  # (pro's 500 tokens a minute on large would refuse it first)
    long = dry_run(compile_policy(to_yaml(doc)), "pro", RequestFeatures(model="large", prompt_tokens=9000,
                                                                        max_tokens=10))
    assert long.pool == "large-us" and any("fallback small: context window 8192 < 9010" in t for t in long.trace)


def test_tests_can_expect_admission_pool_and_region() -> None:
    text = with_tests(
        {"name": "short goes small, in us-east", "request": {"model": "auto", "tier": "free", "prompt": "hi"},
         "expect": {"status": 200, "model": "small", "pool": "small-us", "region": "us-east"}},
        {"name": "long by length alone", "request": {"model": "auto", "tier": "pro", "prompt_tokens": 300,
                                                     "max_tokens": 100},
         "expect": {"model": "large", "region": "us-east"}},
        {"name": "free may not call large", "request": {"model": "large", "tier": "free"},
         "expect": {"status": 403}},
    )
    results = run_policy_tests(compile_policy(text))
    assert [r.passed for r in results] == [True, True, True]
    assert results[1].expected == "model large, region us-east"


def test_a_failing_expectation_blocks_the_document_and_says_why() -> None:
    text = with_tests({"name": "wrong region", "request": {"model": "small", "tier": "pro", "prompt": "hi"},
                       "expect": {"region": "eu-west"}})
    with pytest.raises(PolicyError) as caught:
        compile_checked(text, "p.yaml")
    (issue,) = caught.value.issues
    assert issue.path == "tests[wrong region].expect"
    assert "expected region eu-west, got status 200, model small, pool small-us, region us-east" in issue.message


@pytest.mark.parametrize(("expect", "message"), [
    ({}, "expect at least one of status, model, pool, region, priority"),
    ({"status": 403, "model": "small"}, "a refused request has no model, pool, region or priority to expect"),
    ({"status": 500}, "Input should be 200, 400, 403, 404 or 429"),
    ({"pool": "small-usa"}, "unknown pool 'small-usa'"),
    ({"region": "mars"}, "unknown region 'mars'"),
])
def test_impossible_expectations_are_schema_errors(expect: dict[str, Any], message: str) -> None:
    text = with_tests({"request": {"model": "small", "tier": "pro"}, "expect": expect})
    with pytest.raises(PolicyError) as caught:
        compile_policy(text)
    assert any(message in i.message for i in caught.value.issues), caught.value.issues


def test_tests_can_expect_a_request_larger_than_a_limit_to_be_refused() -> None:
    text = with_tests(
        {"name": "too big for free", "request": {"model": "small", "tier": "free", "prompt_tokens": 900,
                                                 "max_tokens": 200},
         "expect": {"status": 429, "limit": "tokens_per_minute"}},
        {"name": "fits", "request": {"model": "small", "tier": "free", "prompt_tokens": 500, "max_tokens": 200},
         "expect": {"status": 200}},
    )
    assert [r.passed for r in run_policy_tests(compile_policy(text))] == [True, True]
    snapshot = compile_policy(text)
    run = dry_run(snapshot, "free", RequestFeatures(model="small", prompt_tokens=900, max_tokens=200))
    assert (run.status, run.code, run.limit) == (429, "request_too_large", "tokens_per_minute")
    assert run.trace[-1] == ("refused 429 (request_too_large): This request alone needs 1100 tokens, more than the "
                             "tokens_per_minute (tier free) limit of 1000; ask for fewer tokens (max_tokens) or a "
                             "higher limit.")
    assert run.estimated_tokens == 1100
    assert [c.limit for c in run.charges] == ["tokens_per_minute", "tokens_per_day"]
    with pytest.raises(PolicyError, match="expect a limit only with status 429"):
        compile_policy(with_tests({"request": {"model": "small", "tier": "free"},
                                   "expect": {"status": 403, "limit": "tokens_per_minute"}}))


def test_tests_can_expect_the_priority_class() -> None:
    text = with_tests(
        {"name": "free is sheddable", "request": {"model": "small", "tier": "free"},
         "expect": {"priority": "sheddable"}},
        {"name": "pro may lower itself", "request": {"model": "small", "tier": "pro", "priority": "batch"},
         "expect": {"priority": "batch", "pool": "small-us"}},
        {"name": "free cannot raise itself", "request": {"model": "small", "tier": "free", "priority": "critical"},
         "expect": {"priority": "critical"}},
        {"name": "by header", "request": {"model": "small", "tier": "pro",
                                          "headers": {"X-Switchyard-Priority": "sheddable"}},
         "expect": {"priority": "sheddable"}},
    )
    results = run_policy_tests(compile_policy(text))
    assert [r.passed for r in results] == [True, True, False, True]
    assert results[2].got == "status 200, model small, pool small-us, region us-east, priority sheddable"
    run = dry_run(compile_policy(text), "free", RequestFeatures(model="small", prompt_tokens=5), priority="critical")
    assert "a request may only lower its class" in run.trace[2]


def test_the_trace_says_which_cache_rule_applies() -> None:
    snapshot = compile_policy(to_yaml(base()))  # its one rule caches `small`
    features = RequestFeatures(model="small", prompt_tokens=5, max_tokens=10)
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    cached = dry_run(snapshot, "pro", features, body={**body, "temperature": 0})
    assert any(line.startswith("cache rule cache[0] (exact, tenant)") for line in cached.trace), cached.trace
    sampled = dry_run(snapshot, "pro", features, body=body)  # temperature 1 by default: not deterministic
    assert any(line.startswith("response cache: no rule applies") for line in sampled.trace)
    # Without a body the dry run makes one of the features: no temperature, not deterministic.
    assert any(line.startswith("response cache: no rule applies") for line in dry_run(snapshot, "pro", features).trace)
