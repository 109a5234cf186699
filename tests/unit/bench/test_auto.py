"""The ``auto`` scenario's pure parts: reading the policy and the labelled set, the requests it sends, and
what it makes of the gateway's answers (the run itself, with real processes: tests/integration/test_bench_auto.py)."""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from switchyard.bench.labelled import Label, LabelledPrompt, Quality, Split, default_prompts_path, load_prompts
from switchyard.bench.procs import free_ports
from switchyard.bench.results import Result
from switchyard.bench.scenarios import DEFAULT_SCENARIOS, SCENARIOS
from switchyard.bench.scenarios.auto.client import ARM, DUMMY_TOOL, request_body
from switchyard.bench.scenarios.auto.figures import Routed, cost_per_1000, cost_rows, figures, routed_of, tables_of
from switchyard.bench.scenarios.auto.policy import (
    RoutePolicy,
    endpoint_count,
    event_port_offsets,
    shipped_policy,
    with_endpoints,
)

HARD = "Prove there are infinitely many primes, then show the gaps between consecutive primes are unbounded."
EASY = "What is the capital of Australia?"

POLICY = """\
schema: 1
models:
  - {name: s, price: {input_per_mtok: 0.1, output_per_mtok: 0.2}}
  - {name: m, price: {input_per_mtok: 0.4, output_per_mtok: 1.2}}
  - {name: l, price: {input_per_mtok: 1, output_per_mtok: 3}}
routes:
  - name: auto
    rules:
      - {name: hard, when: {classifier: hard}, model: l}
      - {when: {has_tools: true}, model: m}
      - {name: unsure, when: {classifier: unsure}, model: m}
      - {name: odd, when: {classifier: odd, json_mode: true}, model: m}
    default: s
classifiers:
  hard: {type: features, threshold: 0.6}
  unsure: {type: features}
  odd: {type: features}
"""


def _load_safe(text: str) -> Any:
    return YAML(typ="safe", pure=True).load(text)


def test_the_scenario_is_registered_and_runs_by_default() -> None:
    assert SCENARIOS["auto"].landed and "auto" in DEFAULT_SCENARIOS


def test_the_shipped_policy_is_read_as_the_gateway_names_its_rules() -> None:
    policy = RoutePolicy.parse(shipped_policy().read_text())
    assert [r.label for r in policy.rules] == ["hard-to-large", "tools-need-medium", "unsure-to-medium",
                                               "short-and-simple"]
    assert (policy.comparison(), policy.cheapest(), policy.default) == ("large", "small", "medium")
    assert policy.by_price(["large", "small", "medium"]) == ["small", "medium", "large"]
    assert policy.classifier_rule("hard") == 0 and policy.classifier_rule("unsure") == 2
    assert policy.prices["large"].of(1_000_000, 0) == pytest.approx(0.9)


def test_unnamed_rules_compare_to_and_what_a_rule_shows_of_a_classifier() -> None:
    policy = RoutePolicy.parse(POLICY)
    assert [r.label for r in policy.rules] == ["hard", "rules[1]", "unsure", "odd"]
    assert (policy.comparison(), policy.cheapest()) == ("l", "s")
    assert RoutePolicy.parse(POLICY.replace("default: s", "default: s\n    compare_to: m")).comparison() == "m"
    # The first rule's classifier shows on every request; a later one's only where no earlier rule matched.
    assert [policy.predicts("hard", r) for r in ("hard", "rules[1]", "default")] == [True, False, False]
    assert [policy.predicts("unsure", r) for r in ("hard", "rules[1]", "unsure", "odd", "default")] == [
        None, None, True, False, False]
    # A rule with more than the classifier does not say what the classifier said.
    assert policy.classifier_rule("odd") is None and policy.predicts("odd", "default") is None
    with pytest.raises(ValueError, match="no rule 'gone'"):
        policy.rule_index("gone")
    with pytest.raises(ValueError, match="no route 'auto'"):
        RoutePolicy.parse(POLICY.replace("name: auto", "name: other"))
    with pytest.raises(ValueError, match="without a price: x"):
        RoutePolicy.parse(POLICY.replace("default: s", "default: x"))


def test_the_scenario_policy_moves_only_the_endpoints() -> None:
    document = shipped_policy().read_text()
    count = endpoint_count(document)
    assert count == 8  # (seven generating replicas and the embedding one)
    ports = list(range(20001, 20001 + count))
    moved = with_endpoints(document, ports)
    before, after = _load_safe(document), _load_safe(moved)
    urls = [u for p in after["pools"] for u in p["endpoints"]]
    assert urls == [f"http://127.0.0.1:{p}" for p in ports]
    for pool in (*before["pools"], *after["pools"]):
        del pool["endpoints"]
    assert before == after
    assert "# Virtual models: cheap requests go to cheap models." in moved  # comments kept
    for wrong in (ports[:-1], [*ports, 1]):
        with pytest.raises(ValueError, match="ports"):
            with_endpoints(document, wrong)


def test_a_prompt_is_sent_with_its_system_prompt_turns_tools_and_json_mode() -> None:
    plain = request_body(LabelledPrompt("e", "easy", "test", EASY))
    assert plain == {"model": "auto", "messages": [{"role": "user", "content": EASY}], "max_tokens": 1}
    long = request_body(LabelledPrompt("h", "hard", "train", HARD, system="Be terse.", messages=5, tools=True,
                                       json_mode=True))
    # Earlier turns alternate and end with the assistant's, so the prompt is the last user message.
    assert [m["role"] for m in long["messages"]] == ["system", "assistant", "user", "assistant", "user"]
    assert long["messages"][0] == {"role": "system", "content": "Be terse."}
    assert long["messages"][-1] == {"role": "user", "content": HARD}
    assert all(m["content"] == "" for m in long["messages"][1:-1])
    assert long["tools"] == [DUMMY_TOOL] and long["response_format"] == {"type": "json_object"}
    three = request_body(LabelledPrompt("t", "easy", "test", EASY, messages=3))
    assert [m["role"] for m in three["messages"]] == ["user", "assistant", "user"]


def _result(index: int, route: str | None, *, status: int = 200, prompt_tokens: int | None = 100) -> Result:
    r = Result(index, ARM, "t", "easy", "auto", "chat", False, 10, 1, None, 0.0)
    r.status, r.route, r.prompt_tokens = status, route, prompt_tokens
    r.first_token_s, r.done_s, r.chunks = 0.01, 0.01, 1
    return r


def test_the_answer_gives_the_rules_model_the_rule_and_the_engines_tokens() -> None:
    policy = RoutePolicy.parse(POLICY)
    p = LabelledPrompt("h", "hard", "test", HARD, output_tokens=500)
    routed = routed_of(p, _result(0, "model=l; route=auto; rule=hard; class=standard; pool=x"), policy)
    assert (routed.model, routed.served, routed.rule, routed.prompt_tokens) == ("l", "l", "hard", 100)
    assert routed.cost == pytest.approx((100 * 1 + 500 * 3) / 1e6)
    # A downgrade or a fallback served it elsewhere: it counts at the model the rule chose.
    down = routed_of(p, _result(0, "model=m; route=auto; rule=hard; downgraded_from=l; pool=y"), policy)
    fell = routed_of(p, _result(0, "model=s; route=auto; rule=hard; fallback_from=l; pool=y"), policy)
    assert (down.model, down.served, fell.model, fell.served) == ("l", "m", "l", "s")
    assert down.cost == routed.cost
    for failed in (_result(0, None, status=429), _result(0, "model=l; route=auto; rule=hard", prompt_tokens=None),
                   _result(0, "model=l; pool=x")):
        refused = routed_of(p, failed, policy)
        assert not refused.answered and refused.cost == 0.0


def _routed(policy: RoutePolicy, label: Label, model: str | None, rule: str | None, *, split: Split = "test",
            tokens: int = 1000, output: int = 100) -> Routed:
    p = LabelledPrompt(f"{label}-{model}-{rule}-{split}", label, split, "x", output_tokens=output)
    cost = policy.prices[model].of(tokens, output) if model else 0.0
    return Routed(p, 200 if model else 429, model, model, rule, tokens if model else 0, cost)


def test_costs_are_per_1000_answered_requests_at_the_chosen_model() -> None:
    policy = RoutePolicy.parse(POLICY)
    prices = policy.prices
    easy = _routed(policy, "easy", "s", "default")
    hard = _routed(policy, "hard", "l", "hard", output=500)
    refused = _routed(policy, "hard", None, None)
    routed = [easy, hard, refused]
    assert cost_per_1000(routed, prices) == pytest.approx(500 * (easy.cost + hard.cost))
    assert cost_per_1000(routed, prices, "l") == pytest.approx(500 * (prices["l"].of(1000, 100) + hard.cost))
    assert cost_per_1000(routed, prices, {"easy": "s", "hard": "l"}) == pytest.approx(cost_per_1000(routed, prices))
    assert cost_per_1000([], prices) == 0.0 == cost_per_1000([refused], prices)
    rows = cost_rows(routed, prices, "l", "s")
    assert [r["prompts"] for r in rows] == ["easy", "hard", "the set", "a 20%-hard mix"]
    assert [r["n"] for r in rows] == [1, 1, 2, None]
    e, h, _, mix = rows
    for key in ("auto", "all", "labels"):
        assert mix[key] == pytest.approx(0.8 * e[key] + 0.2 * h[key])
    assert h["ratio"] == pytest.approx(1.0) and e["ratio"] == pytest.approx(e["auto"] / e["all"])


def test_figures_from_hand_made_answers() -> None:
    policy = RoutePolicy.parse(POLICY)
    routed = [_routed(policy, "easy", "s", "default"), _routed(policy, "easy", "l", "hard"),
              _routed(policy, "easy", "m", "rules[1]", split="train"), _routed(policy, "hard", "l", "hard"),
              _routed(policy, "hard", "s", "default"), _routed(policy, "hard", "l", "hard", split="train"),
              _routed(policy, "hard", None, None)]
    f = figures(routed, policy)
    assert (f["prompts"], f["refused"], f["refusals"], f["served_elsewhere"]) == (7, 1, {"429": 1}, 0)
    assert (f["compare"], f["cheapest"], f["models"]) == ("l", "s", ["s", "m", "l"])
    rows = {(r["split"], r["label"]): r for r in f["by_label"]}
    assert rows["all", "hard"] == {"split": "all", "label": "hard", "n": 4, "s": 1, "m": 0, "l": 2, "refused": 1}
    assert rows["test", "easy"]["n"] == 2
    assert f["hard_to_cheapest"] == pytest.approx(1 / 3) and f["easy_to_compare"] == pytest.approx(1 / 3)
    assert {m["rule"] for m in f["misrouted"]} == {"default", "hard"}
    assert {(r["rule"], r["easy"], r["hard"]) for r in f["by_rule"]} == {
        ("hard", 1, 2), ("rules[1]", 1, 0), ("unsure", 0, 0), ("odd", 0, 0), ("default", 1, 1)}
    quality = {(r["classifier"], r["split"]): r for r in f["classifiers"]}
    assert set(quality) == {("hard", "test"), ("hard", "train")}
    test = quality["hard", "test"]  # predicted hard: easy-l, hard-l; not: easy-s, hard-s
    assert (test["n"], test["accuracy"], test["precision"], test["recall"]) == (4, 0.5, 0.5, 0.5)
    assert test["threshold"] == 0.6 and test["rule"] == "hard"
    assert (quality["hard", "train"]["n"], quality["hard", "train"]["accuracy"]) == (2, 1.0)
    # unsure is hidden behind earlier rules on some prompts, and odd has no rule of its own: no figures.
    unsure, odd = f["classifiers_not_shown"]
    assert unsure.startswith("classifier unsure (rule unsure): its verdict does not show for 4 of 6 prompts")
    assert "(hard, rules[1])" in unsure and odd.startswith("classifier odd: no rule")
    assert [t["title"] for t in tables_of(f)][-1] == "Hard prompts on s and easy ones on l"


def test_the_labelled_set_loads_and_a_bad_line_is_named(tmp_path: Path) -> None:
    prompts = load_prompts()
    assert default_prompts_path().exists() and len(prompts) > 300
    assert {p.label for p in prompts} == {"easy", "hard"} and {p.split for p in prompts} == {"train", "test"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "label": "easy", "split": "test", "prompt": "hi", "output_tokens": 5}\n\n'
                   '{"id": "b", "label": "meh", "split": "test", "prompt": "hi", "output_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: label must be easy or hard"):
        load_prompts(bad)
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a labelled prompt"):
        load_prompts(bad)


def test_quality_counts_precision_and_recall_for_hard() -> None:
    q = Quality.of([True, True, False, False], [True, False, True, False])
    assert (q.n, q.accuracy, q.precision, q.recall) == (4, 0.5, 0.5, 0.5)
    none = Quality.of([False], [False])
    assert none.accuracy == 1.0 and math.isnan(none.precision) and math.isnan(none.recall)


def test_the_shipped_policys_engines_get_ports_whose_event_ports_are_free_too() -> None:
    document = shipped_policy().read_text()
    offsets = event_port_offsets(document)
    assert offsets == (1000, 2000)  # policies.yaml: each engine publishes on its port + 1000, replays on + 2000
    ports = free_ports(endpoint_count(document), offsets)
    assert len(set(ports)) == len(ports) == endpoint_count(document)
    # Every port and its offsets can be bound (the events socket binds every interface).
    held: list[socket.socket] = []
    try:
        for port in ports:
            for host, offset in (("127.0.0.1", 0), *(("", o) for o in offsets)):
                s = socket.socket()
                held.append(s)
                s.bind((host, port + offset))
    finally:
        for s in held:
            s.close()
