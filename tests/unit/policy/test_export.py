"""Export onto an operator's file: the new content, with the operator's comments and key order."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.policy import PolicyError, parse_policy
from switchyard.policy.diff import canonical, plain_data
from switchyard.policy.export import merge_onto
from switchyard.policy.load import parse_yaml
from tests.unit.policy.base import base, to_yaml

OPERATOR_FILE = """\
# Our gateway policy. Reviewed by the platform team; ask in #gateway before changing tiers.
schema: 1

regions: [us-east, eu-west]

pools:
  # One pool per model and region.
  - name: small-us
    region: us-east
    served_model: llama-8b
    endpoints: [http://127.0.0.1:9001, http://127.0.0.1:9002]
    kv_cache_tokens: 100000
  - name: small-eu  # the EU replica
    region: eu-west
    served_model: llama-8b
    endpoints: [http://127.0.0.1:9003]
    kv_cache_tokens: 100000

models:
  - name: small
    context_window: 8192   # matches --max-model-len
    pools: [small-us, small-eu]
    price: {input_per_mtok: 0.10, output_per_mtok: 0.20}
    fallback: [small@eu-west]

priorities:
  # Best first.
  critical: {max_queue_ms: 5000}
  sheddable: {max_queue_ms: 200, shed_above_utilisation: 0.8}

tiers:
  # Free users get the small model only.
  - name: free
    priority: sheddable
    models: [small]
    limits:
      tokens_per_minute: 1000   # per tenant
      tokens_per_day: 10000     # per tenant, UTC day
  - name: pro
    priority: critical
    models: ["*"]
"""


def _same_content(text: str, expected: str) -> bool:
    return canonical(plain_data(parse_yaml(text, "a"))) == canonical(plain_data(parse_yaml(expected, "b")))


def _content(text: str) -> Any:
    return plain_data(parse_yaml(text, "<test>"))


def test_one_changed_limit_keeps_every_comment_and_the_key_order() -> None:
    parse_policy(OPERATOR_FILE)  # the fixture is a valid policy
    new = _content(OPERATOR_FILE)
    new["tiers"][0]["limits"]["tokens_per_day"] = 20000
    new_text = to_yaml(new)  # what the console published: same content, none of the comments

    merged = merge_onto(OPERATOR_FILE, new_text)

    assert merged.kept_layout
    assert _same_content(merged.text, new_text)
    assert merged.text == OPERATOR_FILE.replace("tokens_per_day: 10000     #", "tokens_per_day: 20000     #")


def test_content_already_there_leaves_the_file_as_it_is() -> None:
    merged = merge_onto(OPERATOR_FILE, to_yaml(_content(OPERATOR_FILE)))
    assert merged.text == OPERATOR_FILE and merged.kept_layout


def test_named_items_added_removed_and_moved_keep_their_comments() -> None:
    new = _content(OPERATOR_FILE)
    eu = new["pools"].pop(1)
    new["pools"].insert(0, eu)  # moved first
    new["tiers"].pop(1)  # pro removed
    new["tiers"].append({"name": "team", "priority": "critical", "models": ["small"]})
    new["models"][0]["max_output_tokens"] = 1024  # a new key
    del new["models"][0]["fallback"]
    new_text = to_yaml(new)

    merged = merge_onto(OPERATOR_FILE, new_text)

    assert merged.kept_layout
    assert _same_content(merged.text, new_text)
    text = merged.text
    for comment in ("# Our gateway policy.", "# the EU replica", "# matches --max-model-len", "# Best first.",
                    "# Free users get the small model only.", "# per tenant, UTC day"):
        assert comment in text
    assert text.index("name: small-eu  # the EU replica") < text.index("name: small-us")
    assert "price: {input_per_mtok: 0.10, output_per_mtok: 0.20}" in text  # untouched values keep their form
    assert "name: pro" not in text and "name: team" in text
    assert text.index("max_output_tokens: 1024") > text.index("price:")  # a new key comes after the old ones


def test_a_new_key_order_is_followed_where_order_means_something() -> None:
    new = _content(OPERATOR_FILE)
    new["priorities"] = dict(reversed(list(new["priorities"].items())))
    merged = merge_onto(OPERATOR_FILE, to_yaml(new))
    assert merged.kept_layout and _same_content(merged.text, to_yaml(new))
    assert merged.text.index("sheddable: {max_queue_ms") < merged.text.index("critical: {max_queue_ms")


def test_block_sequences_at_the_left_margin_stay_there() -> None:
    existing = to_yaml(base())  # "- name: ..." at column 0, mappings indented by 2
    assert "\n- name: small-us\n" in existing
    new = base()
    new["regions"].append("ap-south")
    new["pools"][0]["region"] = "ap-south"
    merged = merge_onto(existing, to_yaml(new))
    assert merged.kept_layout
    assert merged.text == to_yaml(new)


def test_an_anchor_shared_by_parts_that_now_differ_is_rewritten_whole() -> None:
    existing = OPERATOR_FILE.replace("    limits:\n      tokens_per_minute: 1000   # per tenant\n"
                                     "      tokens_per_day: 10000     # per tenant, UTC day\n",
                                     "    limits: &limits {tokens_per_minute: 1000, tokens_per_day: 10000}\n")
    existing = existing.replace('    models: ["*"]\n', '    models: ["*"]\n    limits: *limits\n')
    assert _content(existing)["tiers"][1]["limits"]["tokens_per_day"] == 10000
    new = _content(existing)
    new["tiers"][1]["limits"] = {"tokens_per_minute": 1000, "tokens_per_day": 99999}
    new_text = to_yaml(new)

    merged = merge_onto(existing, new_text)

    assert not merged.kept_layout
    assert merged.text == new_text


def test_an_existing_file_that_is_not_a_policy_mapping_is_refused() -> None:
    with pytest.raises(PolicyError, match="invalid YAML"):
        merge_onto("pools: [", to_yaml(base()), "policies.yaml")
    with pytest.raises(PolicyError, match="not a YAML mapping"):
        merge_onto("- a\n- b\n", to_yaml(base()), "policies.yaml")
