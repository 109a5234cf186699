"""Requests of every kind through the one procedure: embeddings, the Responses API, the tokenizer endpoints, and
models that are embedding models or LoRA adapters, as the policy declares them."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.api.errors import BadRequest
from switchyard.decide.cache import canonical_request, is_deterministic, plan_cache
from switchyard.decide.dryrun import dry_run
from switchyard.decide.features import count_prompts, request_features
from switchyard.decide.policy_tests import run_policy_tests
from switchyard.decide.tokens import ESTIMATE
from switchyard.gateway.body import check_body
from switchyard.policy import PolicyError, compile_policy
from switchyard.policy.snapshot import PolicySnapshot
from tests.unit.policy.base import base, to_yaml


def fleet() -> dict[str, Any]:
    """The base policy with an embedding model (pool ``embed-us``) and two adapters of ``small-us``."""
    doc = base()
    doc["pools"].append({"name": "embed-us", "region": "us-east", "served_model": "bge", "task": "embed",
                         "endpoints": ["http://127.0.0.1:9010"], "kv_cache_tokens": 10000})
    doc["pools"][0]["max_loras"] = 2
    doc["models"] += [
        {"name": "embed", "kind": "embedding", "pools": ["embed-us"], "context_window": 512,
         "price": {"input_per_mtok": 0.02}},
        {"name": "support", "adapter_of": "small-us", "adapter": "support-v2", "context_window": 8192,
         "price": {"input_per_mtok": 0.2, "output_per_mtok": 0.4}},
    ]
    doc["cache"].append({"match": {"models": ["embed"]}, "mode": "exact", "ttl": "1h"})
    doc["tiers"][0]["limits"] = {"tokens_per_minute": 100}
    doc["tiers"][0]["models"] += ["embed"]
    return doc


SNAPSHOT: PolicySnapshot = compile_policy(to_yaml(fleet()))


def run(kind: str, body: dict[str, Any], tier: str = "pro") -> Any:
    check_body(kind, body)
    return dry_run(SNAPSHOT, tier, request_features(kind, body, {}), body=body, kind=kind)  # type: ignore[arg-type]


def test_an_embedding_goes_to_the_embedding_pool_and_reserves_only_its_input() -> None:
    done = run("embedding", {"model": "embed", "input": ["one two three four", "five six"]})
    assert (done.status, done.pool, done.model) == (200, "embed-us", "embed")
    assert done.estimated_tokens == done.prompt_tokens == 7  # (5 + 2 estimated, a token per 4 characters: no output)
    assert any("cache rule" in line for line in done.trace)
    # Counted exactly from token ids; the longest input must fit the window by itself.
    tokens, longest = count_prompts(ESTIMATE, "embedding", {"input": [[1, 2, 3], [4]]})
    assert (tokens, longest) == (4, 3)
    too_long = run("embedding", {"model": "embed", "input": [list(range(600))]})
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    # The free tier's 100 tokens a minute count input tokens.
    assert run("embedding", {"model": "embed", "input": [1] * 99}, tier="free").status == 200
    limited = run("embedding", {"model": "embed", "input": [1] * 101}, tier="free")
    assert (limited.status, limited.limit) == (429, "tokens_per_minute")


def test_a_model_serves_only_its_own_kind_of_request() -> None:
    wrong = run("embedding", {"model": "small", "input": "hi"})
    assert (wrong.status, wrong.code) == (400, "model_not_supported")
    assert "kind embedding" in wrong.trace[-1]
    for kind, body in (("chat", {"messages": [{"role": "user", "content": "hi"}]}), ("completion", {"prompt": "x"}),
                       ("responses", {"input": "hi"})):
        refused = run(kind, {"model": "embed", **body})
        assert (refused.status, refused.code) == (400, "model_not_supported"), kind
    # The tokenizer endpoints serve both kinds.
    assert run("tokenize", {"model": "embed", "prompt": "hi"}).pool == "embed-us"


def test_a_responses_request_is_read_as_the_chat_it_is_rendered_into() -> None:
    body = {"model": "auto", "instructions": "Be brief.", "max_output_tokens": 50,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "please prove this lemma"}]}]}
    features = request_features("responses", body, {})
    assert features.last_user_text == "please prove this lemma" and features.system_text == "Be brief."
    assert features.max_tokens == 50 and features.messages == 2
    done = run("responses", body)
    assert (done.status, done.model) == (200, "large")  # the route's regex rule read the input's text
    assert done.estimated_tokens == done.prompt_tokens + 50
    too_much = run("responses", {"model": "small", "input": "hi", "max_output_tokens": 9000})
    assert too_much.code == "invalid_value" and "max_output_tokens=9000" in too_much.trace[-1]
    # Never cached: a response names a stored response by its id.
    assert plan_cache(SNAPSHOT, kind="responses", model="small", route=None, tier="pro", tenant="t",
                      body={"input": "hi", "temperature": 0}) is None


def test_the_tokenizer_endpoints_charge_nothing_and_never_queue() -> None:
    done = run("tokenize", {"model": "small", "prompt": "hello " * 500}, tier="free")
    assert done.status == 200 and done.charges == () and done.estimated_tokens == 0
    assert any("tokenize: uses only the model's tokenizer" in line for line in done.trace)
    assert run("detokenize", {"model": "small", "tokens": [1, 2]}).pool in ("small-us", "small-eu")
    assert run("tokenize", {"model": "large", "prompt": "hi"}, tier="free").status == 403


def test_an_adapter_is_served_by_its_base_pool() -> None:
    done = run("chat", {"model": "support", "messages": [{"role": "user", "content": "hi"}]})
    assert (done.status, done.pool, done.served_model) == (200, "small-us", "support")
    assert SNAPSHOT.models["support"].served_name == "support-v2" and SNAPSHOT.models["small"].served_name is None


def test_embeddings_are_deterministic_and_keyed_by_their_input() -> None:
    assert is_deterministic({"input": "x"}, "embedding") and not is_deterministic({"input": "x"}, "responses")
    one = canonical_request("embedding", "embed", {"model": "embed", "input": "a", "user": "u1"})
    assert one == canonical_request("embedding", "embed", {"model": "embed", "input": "a", "user": "u2"})
    assert one != canonical_request("embedding", "embed", {"model": "embed", "input": "b"})
    assert one != canonical_request("embedding", "embed", {"model": "embed", "input": "a", "dimensions": 8})


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("embedding", {"model": "e", "input": []}, "input"),
    ("embedding", {"model": "e", "input": ""}, "input"),
    ("embedding", {"model": "e", "input": [1, "a"]}, "input"),
    ("embedding", {"model": "e", "input": [[1], []]}, "input"),
    ("embedding", {"model": "e", "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ("embedding", {"model": "e", "input": "a", "dimensions": 0}, "dimensions"),
    ("embedding", {"model": "e", "input": "a", "stream": True}, "stream"),
    ("responses", {"model": "m"}, "input"),
    ("responses", {"model": "m", "input": []}, "input"),
    ("responses", {"model": "m", "input": ["a"]}, "input[0]"),
    ("responses", {"model": "m", "input": "a", "max_output_tokens": -1}, "max_output_tokens"),
    ("responses", {"model": "m", "input": "a", "background": True}, "background"),
    ("tokenize", {"model": "m"}, "prompt"),
    ("tokenize", {"model": "m", "messages": []}, "messages"),
    ("detokenize", {"model": "m", "tokens": ["a"]}, "tokens"),
    ("detokenize", {"model": "m"}, "tokens"),
])
def test_bad_bodies_are_refused_naming_the_field(kind: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as bad:
        check_body(kind, body)
    assert bad.value.param == param


def test_a_whole_number_given_as_a_float_is_taken_as_the_integer() -> None:
    body = {"model": "m", "input": "a", "max_output_tokens": 64.0}
    check_body("responses", body)
    assert body["max_output_tokens"] == 64 and isinstance(body["max_output_tokens"], int)


def test_policy_tests_can_send_every_kind_of_request() -> None:
    doc = fleet()
    doc["tests"] = [
        {"name": "embeddings", "request": {"model": "embed", "tier": "pro", "kind": "embedding", "prompt": "x"},
         "expect": {"pool": "embed-us"}},
        {"name": "wrong kind", "request": {"model": "embed", "tier": "pro", "prompt": "x"}, "expect": {"status": 400}},
        {"name": "tokenize", "request": {"model": "large", "tier": "free", "kind": "tokenize", "prompt": "x"},
         "expect": {"status": 403}},
        {"name": "responses", "request": {"model": "auto", "tier": "pro", "kind": "responses", "prompt": "prove it"},
         "expect": {"model": "large"}},
    ]
    assert [r.passed for r in run_policy_tests(compile_policy(to_yaml(doc)))] == [True, True, True, True]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["models"][2].update(pools=["small-us"]), "needs pools of task: embed"),
    (lambda d: d["models"][0].update(pools=["embed-us"]), "give the model kind: embedding"),
    (lambda d: d["models"][3].update(adapter_of="nowhere"), "unknown pool 'nowhere'"),
    (lambda d: d["models"][3].update(pools=["large-us"]), "served by its base pool only"),
    (lambda d: d["models"][1].update(adapter="x"), "adapter and adapter_path need adapter_of"),
    (lambda d: d["models"][0]["price"].pop("output_per_mtok"), "price.output_per_mtok is required"),
    (lambda d: d["models"][2].update(fallback=["small"]), "is of kind generate"),
    (lambda d: d["routes"][0]["rules"][0].update(model="embed"), "is of kind embedding"),
])
def test_kinds_and_adapters_are_checked_across_the_document(change: Any, message: str) -> None:
    doc = fleet()
    change(doc)
    with pytest.raises(PolicyError, match=message):
        compile_policy(to_yaml(doc))


def test_token_ids_given_as_whole_floats_are_token_ids() -> None:
    body = {"model": "embed", "input": [[1.0, 2.0], [3.0]]}
    check_body("embedding", body)
    assert request_features("embedding", body, {}).prompt_tokens == 3
    flat = {"model": "embed", "input": [5.0, 6.0, 7.0]}
    check_body("embedding", flat)
    assert request_features("embedding", flat, {}).prompt_tokens == 3
    with pytest.raises(BadRequest):
        check_body("embedding", {"model": "embed", "input": [1.5]})


def test_several_choices_reserve_output_for_each() -> None:
    one = run("chat", {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    three = run("chat", {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3})
    assert three.estimated_tokens - three.prompt_tokens == 3 * (one.estimated_tokens - one.prompt_tokens) == 15
