"""Response-cache planning: which rule applies, the keys, the semantic context, the client's header."""

from __future__ import annotations

import json
from typing import Any

import pytest

from switchyard.api.headers import CACHE_CONTROL_HEADER
from switchyard.decide.cache import (
    BadCacheControl,
    CachePlan,
    CanonicalRequest,
    canonical_request,
    is_deterministic,
    parse_cache_control,
    plan_cache,
    request_digest,
)
from switchyard.policy import PolicySnapshot, compile_policy
from tests.unit.policy.base import base, to_yaml

EMBED_POOL = {"name": "embed-us", "region": "us-east", "served_model": "bge", "task": "embed",
              "endpoints": ["http://127.0.0.1:9009"], "kv_cache_tokens": 1000}


def policy(rules: list[dict[str, Any]]) -> PolicySnapshot:
    doc = base()
    doc["pools"].append(EMBED_POOL)
    doc["cache"] = rules
    return compile_policy(to_yaml(doc))


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return policy([
        {"name": "free-auto", "match": {"routes": ["auto"], "tiers": ["free"]}, "ttl": "1m"},
        {"name": "small-any", "match": {"models": ["small"], "nondeterministic": True}, "ttl": "10m",
         "scope": "global"},
        {"match": {"models": ["large"], "tiers": ["pro"]}, "mode": "semantic", "min_similarity": 0.9,
         "embedding_pool": "embed-us", "ttl": "1h"},
        {"name": "large-exact", "match": {"models": ["large"]}, "ttl": "1h"},
    ])


def chat(content: Any = "What is 2 + 2?", **extra: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def plan(snapshot: PolicySnapshot, body: dict[str, Any], *, model: str = "large", route: str | None = None,
         tier: str = "pro", tenant: str = "t1", kind: Any = "chat", read: bool = True,
         write: bool = True) -> CachePlan | None:
    return plan_cache(snapshot, kind=kind, model=model, route=route, tier=tier, tenant=tenant, body=body,
                      read=read, write=write)


# -- rule selection ---------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "route", "tier", "body", "label"), [
    ("large", "auto", "free", chat(), "free-auto"),
    ("small", "auto", "free", chat(), "free-auto"),
    ("small", None, "free", chat(), "small-any"),
    ("small", "auto", "pro", chat(temperature=0.7), "small-any"),
    ("large", None, "pro", chat(), "cache[2]"),
    ("large", "auto", "free", chat(temperature=0.7), None),
    ("large", None, "free", chat(), "large-exact"),
    ("large", None, "pro", chat([{"type": "image_url", "image_url": {"url": "x"}}]), "large-exact"),
    ("large", None, "pro", chat(temperature=0.7), None),
    ("large", None, "pro", chat(temperature=0.7, seed=3), "cache[2]"),
])
def test_the_first_rule_that_applies_wins(snapshot: PolicySnapshot, model: str, route: str | None, tier: str,
                                          body: dict[str, Any], label: str | None) -> None:
    got = plan(snapshot, body, model=model, route=route, tier=tier)
    assert (got.label if got else None) == label


def test_a_plan_describes_its_rule(snapshot: PolicySnapshot) -> None:
    exact = plan(snapshot, chat(), model="small", tier="free", tenant="acme")
    assert exact is not None
    assert (exact.mode, exact.scope, exact.context, exact.text) == ("exact", "global", "", None)
    assert exact.rule is snapshot.document.cache[1] and len(exact.key) == 64
    assert exact.trace == "cache rule small-any (exact, global): lookup and store; skipped free-auto (no route)"
    semantic = plan(snapshot, chat(), tenant="acme")
    assert semantic is not None
    assert (semantic.mode, semantic.scope, semantic.text) == ("semantic", "tenant:acme", "What is 2 + 2?")
    assert len(semantic.context) == 64 and semantic.context != semantic.key
    assert semantic.trace.startswith("cache rule cache[2] (semantic, tenant): lookup and store")


def test_more_than_one_choice_is_never_cached(snapshot: PolicySnapshot) -> None:
    assert plan(snapshot, chat(n=2), model="small") is None
    assert plan(snapshot, chat(n=1), model="small") is not None


@pytest.mark.parametrize(("read", "write", "usage"), [
    (True, False, "lookup only (client: no-store)"),
    (False, True, "store only (client: no-cache)"),
])
def test_the_client_may_turn_off_reading_or_writing(snapshot: PolicySnapshot, read: bool, write: bool,
                                                    usage: str) -> None:
    got = plan(snapshot, chat(), model="small", read=read, write=write)
    assert got is not None and (got.read, got.write) == (read, write) and f": {usage}" in got.trace
    assert plan(snapshot, chat(), model="small", read=False, write=False) is None


def test_no_rules_no_plan() -> None:
    assert plan(policy([]), chat()) is None


def test_semantic_rules_need_user_text() -> None:
    only = policy([{"mode": "semantic", "min_similarity": 0.8, "embedding_pool": "embed-us", "ttl": 60}])
    assert plan(only, {"messages": [{"role": "system", "content": "hi"}], "temperature": 0}) is None
    assert plan(only, chat("   ")) is None
    assert plan(only, {"prompt": [1, 2, 3], "temperature": 0}, kind="completion") is None
    completion = plan(only, {"prompt": "Once upon", "temperature": 0}, kind="completion")
    assert completion is not None and completion.text == "Once upon"
    parts = plan(only, chat([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}},
                             {"type": "text", "text": "b"}]))
    assert parts is not None and parts.text == "a\nb"


# -- determinism ------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    ({"temperature": 0}, True),
    ({"temperature": 0.0}, True),
    ({"temperature": 0.2, "seed": 7}, True),
    ({"seed": 0}, True),
    ({}, False),
    ({"temperature": 0.2}, False),
    ({"temperature": None}, False),
    ({"temperature": False}, False),
    ({"seed": True}, False),
    ({"seed": 1.5}, False),
    ({"seed": None, "temperature": 1}, False),
])
def test_deterministic_requests(body: dict[str, Any], expected: bool) -> None:
    assert is_deterministic(body) is expected


# -- canonical keys ---------------------------------------------------------------------------


def key(snapshot: PolicySnapshot, body: dict[str, Any], **kw: Any) -> str:
    got = plan(snapshot, body, model=kw.pop("model", "small"), **kw)
    assert got is not None
    return got.key


def test_key_order_whitespace_and_number_spelling_do_not_matter(snapshot: PolicySnapshot) -> None:
    body = {"model": "auto", "temperature": 0, "max_tokens": 10, "top_p": 1,
            "messages": [{"role": "user", "content": "hi", "name": None}]}
    reordered = json.loads('{ "top_p" : 1.0, "messages": [{"content":"hi","role":"user"}],\n'
                           '"max_tokens": 10.0, "temperature": 0.0, "model": "small" }')
    assert key(snapshot, body) == key(snapshot, reordered)
    assert canonical_request("chat", "small", body) == canonical_request("chat", "small", reordered)


@pytest.mark.parametrize("extra", [
    {"stream": True}, {"stream_options": {"include_usage": True}}, {"user": "u-9"}, {"priority": "batch"},
    {"metadata": {"a": "b"}}, {"store": True}, {"service_tier": "flex"}, {"request_id": "r1"},
    {"x-trace": "1"}, {"X-Other": 2}, {"max_tokens": None},
])
def test_parameters_that_do_not_change_the_answer_are_ignored(snapshot: PolicySnapshot,
                                                              extra: dict[str, Any]) -> None:
    assert key(snapshot, chat(**extra)) == key(snapshot, chat())


def test_a_stop_string_is_a_one_element_list(snapshot: PolicySnapshot) -> None:
    assert key(snapshot, chat(stop="\n")) == key(snapshot, chat(stop=["\n"]))


@pytest.mark.parametrize("other", [
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 2?"}]},
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]},
    {"max_tokens": 100},
    {"temperature": 0, "top_p": 0.5},
    {"tools": [{"type": "function", "function": {"name": "add"}}]},
    {"response_format": {"type": "json_object"}},
    {"logprobs": True},
    {"some_engine_option": 1},
    {"temperature": 0, "seed": 1},
])
def test_anything_that_changes_the_answer_changes_the_key(snapshot: PolicySnapshot, other: dict[str, Any]) -> None:
    assert key(snapshot, {**chat(), **other}) != key(snapshot, chat())


def test_absent_and_default_parameters_are_different_keys(snapshot: PolicySnapshot) -> None:
    assert key(snapshot, chat(top_p=1)) != key(snapshot, chat())


def test_the_key_uses_the_resolved_model_and_the_kind(snapshot: PolicySnapshot) -> None:
    asked_small = {**chat(), "model": "small"}
    assert key(snapshot, chat()) == key(snapshot, asked_small)
    assert canonical_request("chat", "small", chat()) != canonical_request("chat", "large", chat())
    completion = {"prompt": "hi", "temperature": 0}
    assert canonical_request("completion", "small", completion) != canonical_request(
        "completion", "small", {**completion, "prompt": ["hi"]})
    assert key(snapshot, completion, kind="completion") != key(snapshot, chat("hi"))


def test_the_key_binds_rule_and_scope(snapshot: PolicySnapshot) -> None:
    # small-any is global: every tenant shares the key; the semantic rule is per tenant.
    assert key(snapshot, chat(), tenant="a") == key(snapshot, chat(), tenant="b")
    assert key(snapshot, chat(), model="large", tenant="a") != key(snapshot, chat(), model="large", tenant="b")
    # Same request, same model, two rules: different keys.
    assert key(snapshot, chat(), model="small", route="auto", tier="free") != key(snapshot, chat(), model="small")


# -- semantic context -------------------------------------------------------------------------


def conversation(last: str, *, system: str = "You are helpful.", earlier: str = "Hello") -> dict[str, Any]:
    return {"model": "large", "temperature": 0, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": earlier},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": last},
    ]}


def semantic(snapshot: PolicySnapshot, body: dict[str, Any], **kw: Any) -> CachePlan:
    got = plan(snapshot, body, **kw)
    assert got is not None and got.mode == "semantic"
    return got


def test_the_same_conversation_with_another_last_turn_shares_the_context(snapshot: PolicySnapshot) -> None:
    a = semantic(snapshot, conversation("What is the capital of France?"))
    b = semantic(snapshot, conversation("France's capital city?"))
    assert a.context == b.context and a.key != b.key
    assert (a.text, b.text) == ("What is the capital of France?", "France's capital city?")


@pytest.mark.parametrize("other", [
    conversation("What is the capital of France?", system="You are a pirate."),
    conversation("What is the capital of France?", earlier="Bonjour"),
    {**conversation("What is the capital of France?"), "max_tokens": 5},
    {**conversation("What is the capital of France?"), "messages": conversation("x")["messages"][2:]},
])
def test_anything_else_changes_the_context(snapshot: PolicySnapshot, other: dict[str, Any]) -> None:
    original = semantic(snapshot, conversation("What is the capital of France?"))
    assert semantic(snapshot, other).context != original.context


def test_the_context_binds_tenant_model_and_images(snapshot: PolicySnapshot) -> None:
    base_plan = semantic(snapshot, conversation("Describe it"), tenant="a")
    assert semantic(snapshot, conversation("Describe it"), tenant="b").context != base_plan.context
    with_image = conversation("x")
    with_image["messages"][-1]["content"] = [{"type": "text", "text": "Describe it"},
                                             {"type": "image_url", "image_url": {"url": "cat.png"}}]
    other_image = json.loads(json.dumps(with_image))
    other_image["messages"][-1]["content"][1]["image_url"]["url"] = "dog.png"
    cat, dog = semantic(snapshot, with_image, tenant="a"), semantic(snapshot, other_image, tenant="a")
    assert cat.text == dog.text == "Describe it"
    assert len({cat.context, dog.context, base_plan.context}) == 3
    only = policy([{"mode": "semantic", "min_similarity": 0.8, "embedding_pool": "embed-us", "ttl": 60}])
    assert semantic(only, conversation("q"), model="small").context != semantic(only, conversation("q")).context


# -- cache-control header ---------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (None, (True, True)),
    ("", (True, True)),
    ("no-cache", (False, True)),
    ("NO-STORE", (True, False)),
    ("bypass", (False, False)),
    (" no-cache , no-store ", (False, False)),
    ("no-store,", (True, False)),
])
def test_cache_control(value: str | None, expected: tuple[bool, bool]) -> None:
    assert parse_cache_control(value) == expected


@pytest.mark.parametrize("value", ["max-age=0", "no-cache, refresh", "nocache"])
def test_unknown_cache_control_tokens_are_refused(value: str) -> None:
    with pytest.raises(BadCacheControl) as error:
        parse_cache_control(value)
    message = str(error.value)
    assert CACHE_CONTROL_HEADER in message and all(t in message for t in ("no-cache", "no-store", "bypass"))
    assert isinstance(error.value, ValueError)


def test_the_request_digest_is_equal_for_requests_the_cache_answers_alike() -> None:
    ask = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    same = {"temperature": 0.0, "stream": True, "user": "u1", "messages": [{"content": "hi", "role": "user"}],
            "model": "auto"}
    assert request_digest("chat", ask) == request_digest("chat", same)
    assert len(request_digest("chat", ask)) == 16
    for other in ({**ask, "model": "small"}, {**ask, "temperature": 0.5}, {**ask, "messages": [
            {"role": "user", "content": "hi!"}]}):
        assert request_digest("chat", other) != request_digest("chat", ask)
    assert request_digest("completion", {"model": "auto", "prompt": "hi"}) != request_digest("chat", ask)


@pytest.mark.parametrize(("kind", "body"), [
    ("chat", {"model": "auto", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                            {"role": "assistant", "content": None, "name": "x"}],
              "temperature": 0.0, "stop": "END", "x-extra": 1, "stream": True}),
    ("completion", {"model": "small", "prompt": ["a", "b"], "seed": 3}),
    ("embedding", {"model": "bge", "input": "text", "dimensions": 8.0}),
])
def test_a_requests_canonical_form_made_once_encodes_as_canonical_request_for_each_model(
        snapshot: PolicySnapshot, kind: Any, body: dict[str, Any]) -> None:
    """The gateway normalises a body once (``CanonicalRequest``) for its digest and its cache key: each encoding
    is what ``canonical_request`` gives for that model, and a plan made with it has the key made without."""
    once = CanonicalRequest(kind, body)
    assert once.digest() == request_digest(kind, body)
    for model in ("small", "large", ""):
        assert once.encode(model) == canonical_request(kind, model, body)
    assert once.encode("small") != once.encode("large")
    plain = plan_cache(snapshot, kind=kind, model="small", route=None, tier="pro", tenant="7", body=body)
    shared = plan_cache(snapshot, kind=kind, model="small", route=None, tier="pro", tenant="7", body=body,
                        canonical=once)
    assert plain is not None and shared is not None and shared.key == plain.key
