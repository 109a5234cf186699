"""Which model a request resolves to, and whether its tier may call it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from switchyard.decide.features import RequestFeatures
from switchyard.policy.schema import Model, RuleConditions
from switchyard.policy.snapshot import PolicySnapshot


class Refused(Exception):
    """The policy refuses the request; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


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
assert set(_CONDITIONS) == set(RuleConditions.model_fields), "every rule condition needs a predicate"


def rule_matches(when: RuleConditions, features: RequestFeatures, tier: str) -> bool:
    """Whether every condition that ``when`` sets holds for the request."""
    for name in when.model_fields_set:
        value = getattr(when, name)
        if value is not None and not _CONDITIONS[name](value, features, tier):
            return False
    return True


def resolve_model(snapshot: PolicySnapshot, tier_name: str, features: RequestFeatures) -> ModelDecision:
    """Resolve the requested model or route for a tenant of ``tier_name``.

    Raises:
        Refused: 403 when the tier is unknown or may not call the model, 404 for an unknown model.
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
    for index, rule in enumerate(route.rules):
        if rule_matches(rule.when, features, tier.name):
            label = rule.name or f"rules[{index}]"
            return ModelDecision(name, snapshot.models[rule.model], route.name, label,
                                 (f"route {route.name}: rule {label} matched → {rule.model}",))
    return ModelDecision(name, snapshot.models[route.default], route.name, "default",
                         (f"route {route.name}: no rule matched → default {route.default}",))
