"""The ``auto`` scenario's policy: the shipped demo ``policies.yaml`` with its endpoints moved to free ports, and
what the figures need of it (the models' prices, the ``auto`` route's rules, the classifiers), read as YAML."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

ROUTE = "auto"


def shipped_policy() -> Path:
    """The demo ``policies.yaml``: inside an installed package, else at the top of a source checkout.

    (``switchyard.resources.demo_policy`` finds it the same way; bench may not import it.)

    Raises:
        FileNotFoundError: Neither exists.
    """
    packaged = Path(str(files("switchyard"))) / "policies.yaml"
    if packaged.exists():
        return packaged
    checkout = Path(__file__).resolve().parents[5] / "policies.yaml"
    if checkout.exists():
        return checkout
    raise FileNotFoundError(f"the shipped policies.yaml is missing (looked in {packaged} and {checkout})")


@dataclass(frozen=True, slots=True)
class Price:
    """A model's prices per million tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def of(self, prompt_tokens: int, output_tokens: int) -> float:
        """What a request of these lengths costs (no cached tokens)."""
        return (prompt_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6

    @property
    def rank(self) -> float:
        """How the route's models are ordered by price (input plus output, as the gateway's trace does)."""
        return self.input_per_mtok + self.output_per_mtok


@dataclass(frozen=True, slots=True)
class RouteRule:
    """One rule of the route: the name the gateway reports it by (``rule=`` in the route header)."""

    label: str
    model: str
    when: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """What the figures need of the policy document: prices, the route's rules and the classifiers."""

    prices: Mapping[str, Price]
    rules: tuple[RouteRule, ...]
    default: str
    compare_to: str | None
    classifiers: Mapping[str, Mapping[str, Any]]

    @classmethod
    def parse(cls, document: str, route: str = ROUTE) -> RoutePolicy:
        """Read ``route`` and the models' prices from a policy document (YAML).

        Raises:
            ValueError: The document has no such route, or a model it names has no price.
        """
        doc = YAML(typ="safe", pure=True).load(document) or {}
        prices = {}
        for m in doc.get("models") or []:
            price = m.get("price") or {}
            prices[str(m["name"])] = Price(float(price.get("input_per_mtok", 0)),
                                           float(price.get("output_per_mtok", 0)))
        found = [r for r in doc.get("routes") or [] if r.get("name") == route]
        if not found:
            raise ValueError(f"the policy has no route {route!r}")
        r = found[0]
        rules = tuple(RouteRule(str(rule.get("name") or f"rules[{i}]"), str(rule["model"]),
                                dict(rule.get("when") or {})) for i, rule in enumerate(r.get("rules") or []))
        policy = cls(prices, rules, str(r["default"]), r.get("compare_to"), dict(doc.get("classifiers") or {}))
        missing = [m for m in policy.targets if m not in prices]
        if missing:
            raise ValueError(f"route {route!r} names models without a price: {', '.join(missing)}")
        return policy

    @property
    def targets(self) -> list[str]:
        """The models the route can choose, rules first, then its default (no repeats)."""
        return list(dict.fromkeys([*(r.model for r in self.rules), self.default]))

    def by_price(self, models: Sequence[str]) -> list[str]:
        """``models`` cheapest first (ties by name)."""
        return sorted(models, key=lambda n: (self.prices[n].rank, n))

    def comparison(self) -> str:
        """The model the route is compared with: its ``compare_to``, else the priciest it can choose."""
        return self.compare_to or self.by_price(self.targets)[-1]

    def cheapest(self) -> str:
        """The cheapest model the route can choose."""
        return self.by_price(self.targets)[0]

    def rule_index(self, label: str) -> int:
        """The position of the rule the route header names (``default``: after every rule).

        Raises:
            ValueError: The route has no such rule.
        """
        if label == "default":
            return len(self.rules)
        for i, rule in enumerate(self.rules):
            if rule.label == label:
                return i
        raise ValueError(f"route {ROUTE!r} has no rule {label!r}")

    def classifier_rule(self, name: str) -> int | None:
        """The first rule whose only condition is ``{classifier: name}`` (None: there is none)."""
        return next((i for i, r in enumerate(self.rules) if dict(r.when) == {"classifier": name}), None)

    def predicts(self, classifier: str, rule: str) -> bool | None:
        """What ``classifier`` said about a request that matched ``rule``, as far as that shows it.

        The rule that is only ``{classifier: NAME}`` matched: it said yes. A later rule (or the
        default) matched: that rule was tried and did not match, so it said no. An earlier rule
        matched: it was never asked, as far as the header shows (None).
        """
        k = self.classifier_rule(classifier)
        if k is None:
            return None
        j = self.rule_index(rule)
        return True if j == k else False if j > k else None


def with_endpoints(document: str, ports: Sequence[int]) -> str:
    """``document`` with its pools' endpoints moved to ``ports`` on 127.0.0.1, in order; the rest as it was.

    Raises:
        ValueError: Not as many ports as endpoints.
    """
    yaml = YAML()
    yaml.width = 4096
    doc = yaml.load(document)
    left = list(ports)
    for pool in doc.get("pools") or []:
        count = len(pool["endpoints"])
        if count > len(left):
            raise ValueError("fewer ports than endpoints")
        pool["endpoints"] = [f"http://127.0.0.1:{p}" for p in left[:count]]
        left = left[count:]
    if left:
        raise ValueError("more ports than endpoints")
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def endpoint_count(document: str) -> int:
    """How many endpoints the document's pools have."""
    doc = YAML(typ="safe", pure=True).load(document) or {}
    return sum(len(p.get("endpoints") or []) for p in doc.get("pools") or [])


def event_port_offsets(document: str) -> tuple[int, ...]:
    """The offsets from an endpoint's HTTP port of the ports its engine's KV events bind (every pool's
    ``kv_events`` ``port_offset`` and ``replay_port_offset``)."""
    doc = YAML(typ="safe", pure=True).load(document) or {}
    found = {offset for pool in doc.get("pools") or [] for key in ("port_offset", "replay_port_offset")
             if isinstance(offset := (pool.get("kv_events") or {}).get(key), int) and offset}
    return tuple(sorted(found))
