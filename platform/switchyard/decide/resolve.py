"""Which model a request resolves to, and whether its tier may call it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from switchyard.decide.admit import estimate
from switchyard.decide.difficulty import difficulty_score
from switchyard.decide.features import RequestFeatures
from switchyard.decide.refusals import Refused
from switchyard.policy.fleet import Model
from switchyard.policy.routes import Route, RuleConditions
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Tier


class NeedsScore(Exception):
    """A rule needs the score of a classifier that calls out (an embedding); the procedure asks its executor
    for it (:class:`switchyard.decide.decision.Score`) and resolves again with it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass(frozen=True, slots=True)
class ModelDecision:
    """The resolved model and why."""

    requested: str
    model: Model
    route: str | None
    rule: str | None
    trace: tuple[str, ...]


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


Condition = Callable[[Any, RequestFeatures, str], bool]

# One predicate per condition field of RuleConditions: (value from the policy, request, tier).
_CONDITIONS: dict[str, Condition] = {
    "prompt_tokens_lt": lambda v, f, _t: f.prompt_tokens < v,
    "prompt_tokens_gte": lambda v, f, _t: f.prompt_tokens >= v,
    "messages_lt": lambda v, f, _t: f.messages < v,
    "messages_gte": lambda v, f, _t: f.messages >= v,
    "max_tokens_lt": lambda v, f, _t: f.max_tokens is not None and f.max_tokens < v,
    "max_tokens_gte": lambda v, f, _t: f.max_tokens is not None and f.max_tokens >= v,
    "has_tools": lambda v, f, _t: f.has_tools == v,
    "json_mode": lambda v, f, _t: f.json_mode == v,
    "has_images": lambda v, f, _t: f.has_images == v,
    "match": lambda v, f, _t: _regex(v).search(f.last_user_text) is not None,
    "no_match": lambda v, f, _t: _regex(v).search(f.last_user_text) is None,
    "system_match": lambda v, f, _t: _regex(v).search(f.system_text) is not None,
    "tier": lambda v, _f, t: t in v,
    "header": lambda v, f, _t: all(f.headers.get(k.lower()) == want for k, want in v.items()),
}
# ``classifier`` is evaluated last, by _Scores (it may need a score from outside).
assert set(_CONDITIONS) | {"classifier"} == set(RuleConditions.model_fields), "every rule condition needs a predicate"


class _Scores:
    """Classifier scores of one request: built-in ones computed on first use, others given by the caller."""

    __slots__ = ("difficulty", "features", "given", "notes", "snapshot", "used")

    def __init__(self, snapshot: PolicySnapshot, features: RequestFeatures,
                 given: Mapping[str, float | None]) -> None:
        self.snapshot = snapshot
        self.features = features
        self.given = given
        self.used: dict[str, float | None] = {}
        self.notes: list[str] = []
        #: The built-in difficulty score, computed once however many `features` classifiers read it.
        self.difficulty: float | None = None

    def says_yes(self, name: str) -> bool:
        spec = self.snapshot.document.classifiers[name]
        if name not in self.used:
            if name in self.given:
                self.used[name] = self.given[name]
            elif spec.type == "features":
                if self.difficulty is None:
                    self.difficulty = difficulty_score(self.features)
                self.used[name] = self.difficulty
            else:
                raise NeedsScore(name)
            score = self.used[name]
            self.notes.append(f"classifier {name} ({spec.type}): "
                              + ("unavailable, rule skipped" if score is None
                                 else f"score {score:.2f} vs threshold {spec.threshold:g}"))
        score = self.used[name]
        return score is not None and score >= spec.threshold


def rule_matches(tests: tuple[tuple[Condition, Any], ...], classifier: str | None, features: RequestFeatures,
                 tier: str, scores: _Scores | None = None) -> bool:
    """Whether every condition of a rule (its compiled ``tests``, then its ``classifier``: classifiers cost most)
    holds for the request."""
    for test, value in tests:
        if not test(value, features, tier):
            return False
    if classifier is not None:
        return scores is not None and scores.says_yes(classifier)
    return True


@dataclass(frozen=True, slots=True)
class _Rule:
    """A route's rule as every request reads it, compiled once per snapshot: its predicates bound to their values
    (the policy's models read once, not on every request)."""

    label: str
    model: str
    tests: tuple[tuple[Condition, Any], ...]
    classifier: str | None


@dataclass(frozen=True, slots=True)
class _Route:
    """A route compiled once per snapshot: its rules, and the model its cost note compares with."""

    rules: tuple[_Rule, ...]
    compare_to: Model


def _compile(snapshot: PolicySnapshot, route: Route) -> _Route:
    """``route`` as :func:`resolve_model` reads it (its conditions in the document's field order)."""
    rules = []
    for index, rule in enumerate(route.rules):
        when, given = rule.when, rule.when.model_fields_set
        tests = tuple((_CONDITIONS[name], getattr(when, name)) for name in RuleConditions.model_fields
                      if name in given and name != "classifier" and getattr(when, name) is not None)
        rules.append(_Rule(rule.name or f"rules[{index}]", rule.model, tests, when.classifier))
    if route.compare_to is not None:
        other = snapshot.models[route.compare_to]
    else:  # the route's most expensive model (price per million tokens, in and out; the name breaks a tie)
        targets = [snapshot.models[r.model] for r in route.rules] + [snapshot.models[route.default]]
        other = max(targets, key=lambda m: (m.price.input_per_mtok + m.price.output_per_mtok, m.name))
    return _Route(tuple(rules), other)


def _compiled(snapshot: PolicySnapshot) -> dict[str, _Route]:
    """The snapshot's routes, compiled on first use (kept in ``snapshot.compiled``)."""
    routes: dict[str, _Route] | None = snapshot.compiled.get("routes")
    if routes is None:
        routes = snapshot.compiled["routes"] = {name: _compile(snapshot, r) for name, r in snapshot.routes.items()}
    return routes


def _cost_note(compiled: _Route, chosen: Model, features: RequestFeatures) -> str:
    """The chosen model's estimated cost against the route's comparison model's."""
    other = compiled.compare_to
    mine = estimate(chosen, features.prompt_tokens, features.max_tokens).spend
    if other is chosen:
        return f"est. cost {mine:.6f} (the comparison model {other.name} itself)"
    theirs = estimate(other, features.prompt_tokens, features.max_tokens).spend
    delta = f"{(mine - theirs) / theirs:+.0%}" if theirs > 0 else "n/a"
    return f"est. cost {mine:.6f} vs {theirs:.6f} on {other.name} ({delta})"


def resolve_model(snapshot: PolicySnapshot, tier_name: str, features: RequestFeatures,
                  scores: Mapping[str, float | None] | None = None) -> ModelDecision:
    """Resolve the requested model or route for a tenant of ``tier_name``.

    ``scores``: classifier scores the caller computed (None: the classifier could not answer, so its
    rules do not match). Built-in (``features``) classifiers are computed here when a rule needs them.

    Raises:
        Refused: 403 when the tier is unknown or may not call the model, 404 for an unknown model.
        NeedsScore: a rule needs a classifier score that is not in ``scores`` and is not built in.
    """
    tier = snapshot.tiers.get(tier_name)
    if tier is None:
        raise Refused(403, "tier_not_in_policy",
                      f"Your tenant's tier '{tier_name}' is not defined in the active policy "
                      f"({snapshot.label}); ask the operator to fix the tenant or the policy.")
    name = features.model
    route = snapshot.routes.get(name)
    model = snapshot.models.get(name)
    if route is None and model is None:
        raise Refused(404, "model_not_found",
                      f"The model `{name}` does not exist or you do not have access to it.", "model")
    if not snapshot.allowed(tier, name):
        raise Refused(403, "model_not_allowed",
                      f"Tier '{tier.name}' may not use the model `{name}`.", "model")
    if model is not None:
        return ModelDecision(name, model, None, None, (f"model {name} requested directly",))
    assert route is not None
    compiled = _compiled(snapshot)[name]
    state = _Scores(snapshot, features, scores or {})
    barred: list[str] = []
    tier_name = tier.name
    for rule in compiled.rules:
        if not snapshot.allowed(tier, rule.model):  # a route never resolves to a model the tier may not use
            barred.append(f"rule {rule.label} → {rule.model}")
            continue
        if rule_matches(rule.tests, rule.classifier, features, tier_name, state):
            label = rule.label
            chosen = snapshot.models[rule.model]
            line = f"route {name}: rule {label} matched → {rule.model}"
            break
    else:
        label, chosen, line = _default_for(snapshot, tier, route)
    skipped = ([f"route {name}: skipped {', '.join(barred)}: tier {tier_name} may not use "
                f"{_names(sorted({b.rsplit(' → ', 1)[1] for b in barred}))}"] if barred else [])
    trace = (*skipped, *state.notes, f"{line}; {_cost_note(compiled, chosen, features)}")
    return ModelDecision(name, chosen, name, label, trace)


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def best_allowed(snapshot: PolicySnapshot, tier: Tier, route: Route) -> Model | None:
    """The model a route falls back on for ``tier`` when its default is one the tier may not use: the most
    expensive of the route's own models that the tier may use (price per million tokens, in and out, as the
    measure of capability), the earlier in the route on a tie; None when the tier may use none of them."""
    allowed = [snapshot.models[m] for m in (*(r.model for r in route.rules), route.default)
               if snapshot.allowed(tier, m)]
    if not allowed:
        return None
    return max(allowed, key=lambda m: m.price.input_per_mtok + m.price.output_per_mtok)


def _default_for(snapshot: PolicySnapshot, tier: Tier, route: Route) -> tuple[str, Model, str]:
    """The label, model and trace line of a route's default for ``tier`` (no allowed rule matched)."""
    if snapshot.allowed(tier, route.default):
        line = f"route {route.name}: no rule matched → default {route.default}"
        return "default", snapshot.models[route.default], line
    best = best_allowed(snapshot, tier, route)
    if best is None:
        raise Refused(403, "model_not_allowed",
                      f"Tier '{tier.name}' may use none of the models the route `{route.name}` chooses from.", "model")
    return ("tier_best", best, f"route {route.name}: no rule matched; the default {route.default} is not allowed for "
            f"tier {tier.name} → {best.name}, its best allowed model of this route")


def unreachable_rules(snapshot: PolicySnapshot) -> list[tuple[tuple[str | int, ...], str]]:
    """Where a tier that may call a route can never take one of its rules (or its default), and why: the
    validator's warnings (the document is valid; these rules fall through for that tier)."""
    found: list[tuple[tuple[str | int, ...], str]] = []
    for ri, route in enumerate(snapshot.document.routes):
        for tier in snapshot.document.tiers:
            if not snapshot.allowed(tier, route.name):
                continue
            for k, rule in enumerate(route.rules):
                if not snapshot.allowed(tier, rule.model):
                    found.append((("routes", ri, "rules", k, "model"),
                                  f"tier {tier.name} may call route {route.name} but never takes this rule: it may not "
                                  f"use {rule.model}, so its requests fall through to the next rule"))
            if not snapshot.allowed(tier, route.default):
                best = best_allowed(snapshot, tier, route)
                then = (f"its requests that match no rule go to {best.name}, its best allowed model of this route"
                        if best is not None else "it may use none of this route's models, so its requests are refused")
                found.append((("routes", ri, "default"),
                              f"tier {tier.name} may call route {route.name} but may not use its default "
                              f"{route.default}: {then}"))
    return found
