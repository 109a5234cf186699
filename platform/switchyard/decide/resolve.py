"""Which model a request resolves to, and whether its tier may call it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

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


def rule_matches(when: RuleConditions, features: RequestFeatures, tier: str) -> bool:
    """Whether every condition that ``when`` sets holds for the request."""
    f = features
    checks = (
        (when.prompt_tokens_lt, lambda v: f.prompt_tokens < v),
        (when.prompt_tokens_gte, lambda v: f.prompt_tokens >= v),
        (when.messages_lt, lambda v: f.messages < v),
        (when.messages_gte, lambda v: f.messages >= v),
        (when.max_tokens_lt, lambda v: f.max_tokens is not None and f.max_tokens < v),
        (when.max_tokens_gte, lambda v: f.max_tokens is not None and f.max_tokens >= v),
        (when.has_tools, lambda v: f.has_tools == v),
        (when.json_mode, lambda v: f.json_mode == v),
        (when.has_images, lambda v: f.has_images == v),
        (when.match, lambda v: _regex(v).search(f.last_user_text) is not None),
        (when.no_match, lambda v: _regex(v).search(f.last_user_text) is None),
        (when.system_match, lambda v: _regex(v).search(f.system_text) is not None),
        (when.tier, lambda v: tier in v),
        (when.header, lambda v: all(f.headers.get(k.lower()) == want for k, want in v.items())),
    )
    return all(check(value) for value, check in checks if value is not None)


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
