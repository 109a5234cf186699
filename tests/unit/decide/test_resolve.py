"""Model resolution and rule evaluation, with no network."""

from __future__ import annotations

import pytest

from switchyard.decide.features import MAX_MATCH_CHARS, chat_features, completion_features
from switchyard.decide.policy_tests import policy_warnings, run_policy_tests
from switchyard.decide.refusals import Refused
from switchyard.decide.resolve import resolve_model
from switchyard.decide.tokens import estimate_chat_tokens, estimate_text_tokens
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    doc = base()
    doc["routes"][0]["rules"] = [
        {"name": "tools", "when": {"has_tools": True}, "model": "large"},
        {"name": "json", "when": {"json_mode": True}, "model": "small"},
        {"name": "images", "when": {"has_images": True}, "model": "large"},
        {"name": "hint", "when": {"header": {"X-Hint": "hard"}}, "model": "large"},
        {"name": "system", "when": {"system_match": "(?i)lawyer"}, "model": "large"},
        {"name": "pro-long-answers", "when": {"tier": ["pro"], "max_tokens_gte": 1000}, "model": "large"},
        {"name": "hard", "when": {"match": "(?i)prove", "messages_lt": 4}, "model": "large"},
        {"name": "short", "when": {"prompt_tokens_lt": 100, "no_match": "(?i)code"}, "model": "small"},
    ]
    return compile_policy(to_yaml(doc))


def chat(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], **extra}


def resolve(snapshot: PolicySnapshot, body: dict[str, object], tier: str = "pro",
            headers: dict[str, str] | None = None) -> tuple[str, str | None]:
    decision = resolve_model(snapshot, tier, chat_features(body, headers or {}))
    return decision.model.name, decision.rule


@pytest.mark.parametrize(("body", "headers", "expected"), [
    (chat("hi"), {}, ("small", "short")),
    (chat("please write code for me"), {}, ("large", "default")),
    (chat("x" * 1000), {}, ("large", "default")),
    (chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), {}, ("large", "tools")),
    (chat("hi", response_format={"type": "json_object"}), {}, ("small", "json")),
    (chat([{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]), {},
     ("large", "images")),
    (chat("hi"), {"x-hint": "hard"}, ("large", "hint")),
    (chat("hi"), {"x-hint": "easy"}, ("small", "short")),
    (chat("hi", max_tokens=2000), {}, ("large", "pro-long-answers")),
    (chat("Prove it"), {}, ("large", "hard")),
])
def test_route_rules_first_match_wins(snapshot: PolicySnapshot, body: dict[str, object],
                                      headers: dict[str, str], expected: tuple[str, str]) -> None:
    assert resolve(snapshot, body, headers=headers) == expected


def test_a_snapshot_compiles_its_routes_once_and_each_snapshot_resolves_by_its_own() -> None:
    doc = base()
    doc["routes"][0]["rules"] = [{"name": "short", "when": {"prompt_tokens_lt": 100}, "model": "small"}]
    first = compile_policy(to_yaml(doc))
    assert resolve(first, chat("hi")) == ("small", "short")
    compiled = first.compiled["routes"]
    assert resolve(first, chat("x" * 1000)) == ("large", "default")
    assert first.compiled["routes"] is compiled  # made on the first request, read by the next ones
    doc["routes"][0]["rules"][0]["model"] = "large"  # a reload: a new snapshot with its own rules
    second = compile_policy(to_yaml(doc))
    assert resolve(second, chat("hi")) == ("large", "short")
    assert resolve(first, chat("hi")) == ("small", "short")


def test_system_prompt_rule(snapshot: PolicySnapshot) -> None:
    body = {"model": "auto", "messages": [{"role": "system", "content": "You are a Lawyer."},
                                          {"role": "user", "content": "hi"}]}
    assert resolve(snapshot, body) == ("large", "system")


def test_tier_condition_only_for_that_tier(snapshot: PolicySnapshot) -> None:
    assert resolve(snapshot, chat("hi", max_tokens=2000), tier="free") == ("small", "short")


def test_direct_model_and_refusals(snapshot: PolicySnapshot) -> None:
    assert resolve(snapshot, {**chat(), "model": "large"}) == ("large", None)
    with pytest.raises(Refused) as caught:
        resolve(snapshot, {**chat(), "model": "large"}, tier="free")
    assert (caught.value.status, caught.value.code) == (403, "model_not_allowed")
    with pytest.raises(Refused) as caught:
        resolve(snapshot, {**chat(), "model": "gpt-9"})
    assert (caught.value.status, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    with pytest.raises(Refused) as caught:
        resolve(snapshot, chat(), tier="gold")
    assert (caught.value.status, caught.value.code) == (403, "tier_not_in_policy")


def test_regex_sees_a_bounded_tail(snapshot: PolicySnapshot) -> None:
    features = chat_features(chat("prove " + "x" * (MAX_MATCH_CHARS * 2)), {})
    assert len(features.last_user_text) == MAX_MATCH_CHARS


def test_completion_features() -> None:
    f = completion_features({"model": "m", "prompt": "abcdefgh", "max_tokens": 5}, {})
    assert (f.prompt_tokens, f.max_tokens, f.last_user_text) == (2, 5, "abcdefgh")
    assert completion_features({"model": "m", "prompt": [1, 2, 3]}, {}).prompt_tokens == 3
    assert completion_features({"model": "m", "prompt": [[1, 2], [3]]}, {}).prompt_tokens == 3


def test_token_estimate() -> None:
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd") == 1
    assert estimate_text_tokens("abcde") == 2
    assert estimate_chat_tokens(["abcd", "abcd"]) == 2 + 8


def test_policy_tests_report_pass_and_fail(snapshot: PolicySnapshot) -> None:
    (result,) = run_policy_tests(snapshot)
    assert result.passed and result.expected == "model small"
    assert result.got == "status 200, model small, pool small-us, region us-east"


def test_a_route_never_resolves_to_a_model_the_tier_may_not_use() -> None:
    """``free`` may call ``auto`` and ``small`` only: auto's rule to large falls through for it, and its
    default (large) becomes small, the best model of the route free may use; the trace says both."""
    snapshot = compile_policy(to_yaml(base()))
    assert resolve(snapshot, chat("Prove it"), tier="pro") == ("large", "hard")
    decision = resolve_model(snapshot, "free", chat_features(chat("Prove it " + "x" * 600), {}))
    assert (decision.model.name, decision.rule) == ("small", "tier_best")
    trace = " | ".join(decision.trace)
    assert "skipped rule hard → large: tier free may not use large" in trace
    assert "the default large is not allowed for tier free → small" in trace
    assert resolve(snapshot, chat("Prove it"), tier="free") == ("small", "short")  # a rule it may take still wins


def test_a_tier_that_may_use_none_of_a_routes_models_is_refused() -> None:
    doc = base()
    doc["tiers"][0]["models"] = ["auto"]
    doc["tests"] = []
    snapshot = compile_policy(to_yaml(doc))
    with pytest.raises(Refused) as refused:
        resolve_model(snapshot, "free", chat_features(chat("hi"), {}))
    assert refused.value.status == 403 and refused.value.code == "model_not_allowed"
    assert "may use none of the models the route `auto` chooses from" in refused.value.message


def test_the_validator_warns_about_rules_a_tier_can_never_take() -> None:
    text = to_yaml(base())
    warnings = policy_warnings(compile_policy(text), "p.yaml")
    assert [(w.path, w.source) for w in warnings] == [("routes[auto].rules[hard].model", "p.yaml"),
                                                      ("routes[auto].default", "p.yaml")]
    lines = text.splitlines()
    assert all(w.line is not None and lines[w.line - 1].strip().startswith(("model:", "default:")) for w in warnings)
    assert "tier free may call route auto but never takes this rule: it may not use large" in warnings[0].message
    assert "its requests that match no rule go to small" in warnings[1].message
    doc = base()
    doc["tiers"][0]["models"] = ["small"]  # free cannot call auto at all: nothing to warn about
    assert policy_warnings(compile_policy(to_yaml(doc)), "p.yaml") == []
