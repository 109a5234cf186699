"""The bad-policy catalogue: each mistake is rejected with its path, message and YAML line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyError
from tests.unit.policy.base import base, to_yaml

Doc = dict[str, Any]


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Doc], Any]
    path: str
    message: str
    line_has: str | None = None  # text the reported line must contain


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _del(path: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]
    return mutate


def _append(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node: Any = doc
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else node[part]
        node.append(value)
    return mutate


def _rename_key(path: str, old: str, new: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node: Any = doc
        for part in path.split(".") if path else []:
            node = node[int(part)] if part.isdigit() else node[part]
        node[new] = node.pop(old)
    return mutate


CATALOGUE = [
    Case("wrong schema version", _set("schema", 2), "schema", "Input should be 1", "schema: 2"),
    Case("missing section", _del("models"), "models", "required field is missing"),
    Case("unknown section with suggestion", _rename_key("", "tiers", "tiersx"), "tiersx",
         "unknown field 'tiersx'; did you mean 'tiers'?", "tiersx:"),
    Case("unknown nested field with suggestion", _rename_key("tiers.0.limits", "tokens_per_day", "tokens_per_dya"),
         "tiers[free].limits.tokens_per_dya", "did you mean 'tokens_per_day'?", "tokens_per_dya"),
    Case("empty pools", _set("pools", []), "pools", "must not be empty"),
    Case("invalid region name", _set("regions.1", "EU West"), "regions[1]", "is not a valid name", "EU West"),
    Case("duplicate region", _set("regions.1", "us-east"), "regions[1]", "duplicate region 'us-east'"),
    Case("pool in unknown region", _set("pools.0.region", "us-esat"), "pools[small-us].region",
         "unknown region 'us-esat'; did you mean 'us-east'?", "us-esat"),
    Case("endpoint without scheme", _set("pools.0.endpoints.0", "127.0.0.1:9001"), "pools[small-us].endpoints[0]",
         "must start with http:// or https://", "127.0.0.1:9001"),
    Case("endpoint with /v1", _set("pools.0.endpoints.0", "http://127.0.0.1:9001/v1"),
         "pools[small-us].endpoints[0]", "without /v1", "/v1"),
    Case("endpoint listed twice in a pool", _set("pools.0.endpoints.1", "http://127.0.0.1:9001"),
         "pools[small-us]", "is listed twice"),
    Case("endpoint in two pools", _set("pools.1.endpoints.0", "http://127.0.0.1:9001"),
         "pools[small-eu].endpoints[0]", "is already in pool 'small-us'", "9001"),
    Case("kv_events without sockets", _set("pools.0.kv_events", {"topic": "kv"}), "pools[small-us].kv_events",
         "give `port`, `port_offset` or `sockets`"),
    Case("kv_events binding address", _set("pools.0.kv_events", {"sockets": {
        "http://127.0.0.1:9001": {"events": "tcp://*:5557"}}, "port": 5557}),
         "pools[small-us].kv_events.sockets.http://127.0.0.1:9001.events", "must be tcp://HOST:PORT"),
    Case("kv_events sockets of another pool's endpoint", _set("pools.0.kv_events", {"port": 5557, "sockets": {
        "http://127.0.0.1:9003": {"events": "ipc:///tmp/e"}}}), "pools[small-us]", "not an endpoint of the pool"),
    Case("kv_events port offset out of range", _set("pools.0.kv_events", {"port_offset": 60000}),
         "pools[small-us]", "outside 1-65535"),
    Case("zero KV capacity", _set("pools.0.kv_cache_tokens", 0), "pools[small-us].kv_cache_tokens", "must be > 0",
         "kv_cache_tokens: 0"),
    Case("duplicate pool", _set("pools.1.name", "small-us"), "pools[small-us].name", "duplicate pool 'small-us'"),
    Case("model on unknown pool", _set("models.1.pools.0", "large-eu"), "models[large].pools[0]",
         "unknown pool 'large-eu'", "large-eu"),
    Case("duplicate model", _set("models.1.name", "small"), "models[small].name", "duplicate model 'small'"),
    Case("context window not an integer", _set("models.0.context_window", "big"),
         "models[small].context_window", "must be an integer", "context_window: big"),
    Case("output cap above context", _set("models.0.max_output_tokens", 9000), "models[small]",
         "max_output_tokens (9000) exceeds context_window (8192)"),
    Case("negative price", _set("models.0.price.input_per_mtok", -1), "models[small].price.input_per_mtok",
         "must be >= 0", "input_per_mtok: -1"),
    Case("fallback to unknown model", _set("models.1.fallback.0", "smal"), "models[large].fallback[0]",
         "unknown model 'smal'; did you mean 'small'?", "smal"),
    Case("fallback to unknown region", _set("models.0.fallback.0", "small@mars"), "models[small].fallback[0]",
         "unknown region 'mars'", "small@mars"),
    Case("fallback region without a pool", _set("models.1.fallback.0", "large@eu-west"),
         "models[large].fallback[0]", "model 'large' has no pool in region 'eu-west'", "large@eu-west"),
    Case("fallback to itself", _set("models.1.fallback.0", "large"), "models[large].fallback[0]",
         "cannot fall back to itself"),
    Case("malformed fallback", _set("models.1.fallback.0", "small@@x"), "models[large].fallback[0]",
         "must be 'model' or 'model@region'", "small@@x"),
    Case("fallback cycle", _append("models.0.fallback", "large"), "models[small].fallback",
         "fallback cycle: small → large → small", "fallback:"),
    Case("route named like a model", _set("routes.0.name", "small"), "routes[small].name",
         "route 'small' has the name of a model"),
    Case("rule to unknown model", _set("routes.0.rules.0.model", "larg"), "routes[auto].rules[hard].model",
         "unknown model 'larg'; did you mean 'large'?", "larg"),
    Case("route default is a route", _set("routes.0.default", "auto"), "routes[auto].default",
         "'auto' is a route; a route must resolve to a model", "default: auto"),
    Case("invalid regex", _set("routes.0.rules.0.when.match", "(unclosed"), "routes[auto].rules[hard].when.match",
         "invalid regular expression", "(unclosed"),
    Case("rule without conditions", _set("routes.0.rules.0.when", {}), "routes[auto].rules[hard].when",
         "a rule needs at least one condition"),
    Case("contradictory rule", _set("routes.0.rules.1.when", {"prompt_tokens_gte": 500, "prompt_tokens_lt": 100}),
         "routes[auto].rules[short].when", "can never match"),
    Case("rule on unknown tier", _set("routes.0.rules.1.when", {"tier": ["gold"]}),
         "routes[auto].rules[short].when.tier[0]", "unknown tier 'gold'", "gold"),
    Case("interactive class without deadline", _set("priorities.critical", {"shed_above_utilisation": 0.9}),
         "priorities.critical", "needs max_queue_ms"),
    Case("shed threshold above 1", _set("priorities.sheddable.shed_above_utilisation", 1.5),
         "priorities.sheddable.shed_above_utilisation", "must be <= 1", "1.5"),
    Case("unknown lane", _set("priorities.batch.lane", "bulk"), "priorities.batch.lane",
         "Input should be 'interactive' or 'batch'", "bulk"),
    Case("batch ceiling on an interactive class", _set("priorities.critical.max_utilisation", 0.5),
         "priorities.critical", "max_utilisation applies to the batch lane only"),
    Case("downgrade to an unknown model", _set("models.1.on_saturation", {"downgrade_to": "medium"}),
         "models[large].on_saturation.downgrade_to", "unknown model 'medium'", "medium"),
    Case("downgrade to itself", _set("models.1.on_saturation", {"downgrade_to": "large"}),
         "models[large].on_saturation.downgrade_to", "a model cannot downgrade to itself"),
    Case("downgrade of an unknown class",
         _set("models.1.on_saturation", {"downgrade_to": "small", "classes": ["shedable"]}),
         "models[large].on_saturation.classes[0]", "unknown priority class 'shedable'", "shedable"),
    Case("test asking for an unknown class", _set("tests.0.request.priority", "urgent"),
         "tests[hi is small].request.priority", "unknown priority class 'urgent'", "urgent"),
    Case("tier with unknown priority", _set("tiers.0.priority", "shedable"), "tiers[free].priority",
         "unknown priority class 'shedable'; did you mean 'sheddable'?", "shedable"),
    Case("tier with unknown model", _set("tiers.0.models.1", "tiny"), "tiers[free].models[1]",
         "unknown model or route 'tiny'", "tiny"),
    Case("duplicate tier", _set("tiers.1.name", "free"), "tiers[free].name", "duplicate tier 'free'"),
    Case("minute limit above day limit", _set("tiers.0.limits.tokens_per_minute", 50000), "tiers[free].limits",
         "tokens_per_minute (50000) exceeds tokens_per_day (10000)"),
    Case("limits for a model the tier cannot use",
         _set("tiers.0.model_limits", {"large": {"tokens_per_minute": 10}}), "tiers[free].model_limits.large",
         "limits for 'large', which this tier cannot use", "large:"),
    Case("cache rule on unknown model", _set("cache.0.match.models.0", "medium"), "cache[0].match.models[0]",
         "unknown model 'medium'", "medium"),
    Case("semantic rule without similarity", _set("cache.0.mode", "semantic"), "cache[0]",
         "a semantic rule needs min_similarity"),
    Case("exact rule with similarity", _set("cache.0.min_similarity", 0.9), "cache[0]",
         "apply to mode: semantic only"),
    Case("bad ttl", _set("cache.0.ttl", "forever"), "cache[0].ttl", "invalid duration 'forever'", "forever"),
    Case("semantic rule on an unknown pool", _set("cache.0", {"match": {"models": ["small"]}, "mode": "semantic",
                                                          "min_similarity": 0.9, "embedding_pool": "emb", "ttl": 60}),
         "cache[0].embedding_pool", "unknown pool 'emb'", "emb"),
    Case("semantic rule on a generation pool", _set("cache.0", {"mode": "semantic", "min_similarity": 0.9,
                                                               "embedding_pool": "small-us", "ttl": 60}),
         "cache[0].embedding_pool", "an embedding pool needs `task: embed`", "small-us"),
    Case("hit charge above one", _set("cache.0.hit_charge", 2), "cache[0].hit_charge", "must be <= 1", "hit_charge"),
    Case("test on unknown tier", _set("tests.0.request.tier", "gold"), "tests[hi is small].request.tier",
         "unknown tier 'gold'", "gold"),
    Case("test expecting unknown model", _set("tests.0.expect.model", "medium"), "tests[hi is small].expect.model",
         "unknown model 'medium'", "medium"),
    Case("test expecting two outcomes", _set("tests.0.expect", {"model": "small", "status": 403}),
         "tests[hi is small].expect", "a refused request has no model, pool, region or priority to expect"),
    Case("failing policy test", _set("tests.0.expect.model", "large"), "tests[hi is small].expect",
         "policy test 'hi is small' failed: expected model large, got status 200, model small"),
    Case("breaker open for no time", _set("resilience", {"breakers": {"endpoint": {"open_for": "0s"}}}),
         "resilience.breakers.endpoint.open_for", "a duration must be > 0", "open_for"),
    Case("error rate above one", _set("resilience", {"breakers": {"pool": {"error_rate": 1.5}}}),
         "resilience.breakers.pool.error_rate", "must be <= 1", "error_rate"),
    Case("zero attempts", _set("resilience", {"retries": {"max_attempts": 0}}), "resilience.retries.max_attempts",
         "must be >= 1", "max_attempts"),
    Case("unknown dependency mode", _set("resilience", {"dependencies": {"redis": "shrug"}}),
         "resilience.dependencies.redis", "'fail_open' or 'fail_closed'", "shrug"),
    Case("bad first-token timeout", _set("models.0.first_token_timeout", "soon"), "models[small].first_token_timeout",
         "invalid duration 'soon'", "soon"),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_bad_policy_is_rejected_with_its_location(case: Case) -> None:
    doc = base()
    case.mutate(doc)
    text = to_yaml(doc)
    with pytest.raises(PolicyError) as caught:
        compile_checked(text, "bad.yaml")
    issues = caught.value.issues
    matching = [i for i in issues if i.path == case.path and case.message in i.message]
    assert matching, f"expected {case.path}: …{case.message}…, got:\n" + "\n".join(map(str, issues))
    issue = matching[0]
    assert issue.source == "bad.yaml"
    assert issue.line is not None
    lines = text.splitlines()
    assert 1 <= issue.line <= len(lines)
    if case.line_has is not None:
        assert case.line_has in lines[issue.line - 1], f"line {issue.line} is {lines[issue.line - 1]!r}"
    assert str(issue) == f"{issue.path}: {issue.message} (bad.yaml:{issue.line})"


def test_catalogue_is_large_and_distinct() -> None:
    assert len(CATALOGUE) >= 20
    assert len({(c.path, c.message) for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize(("text", "message", "line"), [
    # YAML mistakes, worded plainly and placed where the mistake is (not where the parser noticed it)
    ("schema: 1\nregions: [a\npools: []\n", "invalid YAML: the [ opened at line 2 is not closed with ]", 2),
    ("schema: 1\nschema: 1\n", 'invalid YAML: the key "schema" appears twice in one mapping (first at line 1)', 2),
    ('schema: 1\nregions: ["a\npools: []\n', "invalid YAML: a quoted string that opens at line 2 is never closed", 2),
    ("schema: 1\nregions:\n\t- a\n", "invalid YAML: a tab character: YAML indents with spaces only", 3),
    ("schema: 1\nregions:\n  - a\n - b\n", "invalid YAML: this line's indentation does not match", 4),
    ("schema: 1\nnote: a: b\n", "invalid YAML: a colon where a value was expected", 2),
    ("- just\n- a list\n", "the document must be a YAML mapping of sections", 1),
])
def test_unparseable_documents(text: str, message: str, line: int) -> None:
    with pytest.raises(PolicyError) as caught:
        compile_checked(text, "x.yaml")
    (issue,) = caught.value.issues
    assert message in issue.message
    assert issue.line == line


def test_every_error_is_reported_not_just_the_first() -> None:
    doc = base()
    doc["pools"][0]["region"] = "nowhere"
    doc["tiers"][0]["priority"] = "nothing"
    with pytest.raises(PolicyError) as caught:
        compile_checked(to_yaml(doc), "x.yaml")
    paths = [i.path for i in caught.value.issues]
    assert paths == ["pools[small-us].region", "tiers[free].priority"]
