"""The section-aware policy diff: named items matched by name, meaning over layout."""

from __future__ import annotations

import pytest

from switchyard.policy import PolicyError
from switchyard.policy.diff import NO_SEMANTIC_CHANGE, diff_documents
from tests.unit.policy.base import base, to_yaml

COMMENTED = """\
# The demo policy, trimmed.
schema: 1
regions: [us-east, eu-west]
pools:
  - {name: small-us, region: us-east, served_model: llama-8b, endpoints: [http://127.0.0.1:9001],
     kv_cache_tokens: 100000}
models:
  - name: small   # the cheap one
    pools: [small-us]
    context_window: 8192
    price: {input_per_mtok: 0.10, output_per_mtok: 0.20}
priorities:
  standard: {max_queue_ms: 1500}
tiers:
  - {name: free, priority: standard, models: [small], limits: {tokens_per_day: 200000}}
"""


def test_named_items_are_matched_by_name_not_position() -> None:
    old, new = base(), base()
    new["tiers"].reverse()
    new["pools"].reverse()
    new["tiers"][1]["limits"]["tokens_per_day"] = 5000  # free, now second
    result = diff_documents(to_yaml(old), to_yaml(new))
    assert result.changes == ("tier free: limits.tokens_per_day 10000 → 5000",)


def test_nested_changes_name_their_path() -> None:
    old, new = base(), base()
    new["models"][1]["fallback"] = []
    new["priorities"]["critical"]["max_queue_ms"] = 6000
    new["routes"][0]["rules"][1]["when"]["prompt_tokens_lt"] = 200
    new["tiers"][1]["model_limits"]["large"]["tokens_per_minute"] = 900
    new["cache"][0]["ttl"] = "1h"
    new["pools"][0]["endpoints"] = ["http://127.0.0.1:9001"]
    assert diff_documents(to_yaml(old), to_yaml(new)).changes == (
        "pool small-us: endpoints [http://127.0.0.1:9001, http://127.0.0.1:9002] → [http://127.0.0.1:9001]",
        "model large: fallback [small] → []",
        "route auto: rules[short].when.prompt_tokens_lt 100 → 200",
        "priorities.critical.max_queue_ms 5000 → 6000",
        "tier pro: model_limits.large.tokens_per_minute 500 → 900",
        "cache[0].ttl 10m → 1h",
    )


def test_added_and_removed_items_keys_regions_and_tests() -> None:
    old, new = base(), base()
    new["regions"] = ["us-east", "ap-south"]
    new["pools"].append({"name": "large-eu", "region": "ap-south", "served_model": "llama-70b",
                         "endpoints": ["http://127.0.0.1:9005"], "kv_cache_tokens": 1000})
    del new["routes"][0]
    new["priorities"]["standard"] = {"max_queue_ms": 1500}
    del new["priorities"]["batch"]
    new["tiers"][0]["limits"]["spend_per_month"] = 100.0
    del new["tiers"][0]["limits"]["tokens_per_minute"]
    new["tests"].append({"request": {"model": "small", "tier": "pro"}, "expect": {"model": "small"}})
    new["tests"].append({"request": {"model": "large", "tier": "pro"}, "expect": {"model": "large"}})
    new["tests"][0]["expect"] = {"model": "large"}
    assert diff_documents(to_yaml(old), to_yaml(new)).changes == (
        "regions: added ap-south",
        "regions: removed eu-west",
        "pool large-eu: added",
        "route auto: removed",
        "priorities.batch: removed",
        "priorities.standard: added",
        "tier free: limits.tokens_per_minute: removed (was 1000)",
        "tier free: limits.spend_per_month: added 100.0",
        "tests: 3 added, 1 removed",
    )


def test_order_changes_are_said_where_order_means_something() -> None:
    old, new = base(), base()
    new["priorities"] = dict(reversed(list(new["priorities"].items())))  # classes are ranked best first
    new["routes"][0]["rules"].reverse()  # the first matching rule wins
    new["pools"][0] = dict(reversed(list(new["pools"][0].items())))  # a pool's key order means nothing
    assert diff_documents(to_yaml(old), to_yaml(new)).changes == (
        "route auto: rules: order [hard, short] → [short, hard]",
        "priorities: order [critical, sheddable, batch] → [batch, sheddable, critical]",
    )


def test_comments_and_layout_alone_are_no_semantic_change() -> None:
    reformatted = (COMMENTED.replace("# the cheap one", "# still the cheap one")
                   .replace("regions: [us-east, eu-west]", "regions:\n  - us-east\n  - eu-west")
                   .replace("0.10", "0.1"))
    result = diff_documents(COMMENTED, reformatted, "v6", "v7")
    assert result.changes == ()
    assert not result.semantic
    assert result.lines() == [NO_SEMANTIC_CHANGE]
    assert result.unified.startswith("--- v6\n+++ v7\n")
    assert "+  - us-east" in result.unified and "-regions: [us-east, eu-west]" in result.unified


def test_identical_text_has_no_diff_at_all() -> None:
    result = diff_documents(COMMENTED, COMMENTED)
    assert (result.changes, result.unified) == ((), "")
    assert result.as_dict() == {"semantic": False, "changes": [], "unified": ""}


def test_value_types_are_told_apart() -> None:
    changed = COMMENTED.replace("tokens_per_day: 200000", 'tokens_per_day: "200000"')
    assert diff_documents(COMMENTED, changed).changes == ('tier free: limits.tokens_per_day 200000 → "200000"',)


def test_not_yaml_is_a_located_error() -> None:
    with pytest.raises(PolicyError) as raised:
        diff_documents(COMMENTED, "schema: [1", "v1", "candidate.yaml")
    (issue,) = raised.value.issues
    assert issue.source == "candidate.yaml" and issue.message.startswith("invalid YAML")
