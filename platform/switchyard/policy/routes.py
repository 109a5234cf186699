"""The ``routes`` section of the policy document: virtual models whose rules choose a concrete model."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, PositiveInt, StringConstraints, model_validator

from switchyard.policy.base import ModelName, Name, Strict


def _check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
    return pattern


Regex = Annotated[str, StringConstraints(min_length=1), AfterValidator(_check_regex)]


class RuleConditions(Strict):
    """Conditions of a routing rule; all given conditions must hold (logical AND)."""

    prompt_tokens_lt: PositiveInt | None = None
    prompt_tokens_gte: PositiveInt | None = None
    messages_lt: PositiveInt | None = None
    messages_gte: PositiveInt | None = None
    max_tokens_lt: PositiveInt | None = None
    max_tokens_gte: PositiveInt | None = None
    has_tools: bool | None = None
    json_mode: bool | None = None
    has_images: bool | None = None
    match: Regex | None = Field(default=None, description="Regex searched in the last user message.")
    no_match: Regex | None = Field(default=None, description="Regex that must not occur in the last user message.")
    system_match: Regex | None = Field(default=None, description="Regex searched in the system prompt.")
    tier: list[Name] | None = Field(default=None, min_length=1)
    header: dict[str, str] | None = Field(
        default=None, min_length=1, description="Request headers that must carry exactly these values."
    )
    classifier: Name | None = Field(
        default=None, description="A classifier of the `classifiers` section that must say yes (its score is at "
        "least its threshold).")

    @model_validator(mode="after")
    def _not_empty_or_contradictory(self) -> RuleConditions:
        if not self.model_fields_set:
            raise ValueError("a rule needs at least one condition (use the route's default instead)")
        for low, high in (("prompt_tokens_gte", "prompt_tokens_lt"), ("messages_gte", "messages_lt"),
                          ("max_tokens_gte", "max_tokens_lt")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo >= hi:
                raise ValueError(f"{low} ({lo}) >= {high} ({hi}): the rule can never match")
        return self


class Rule(Strict):
    """A routing rule: when the conditions hold, the route resolves to ``model``."""

    name: str | None = None
    when: RuleConditions
    model: ModelName


class Route(Strict):
    """A virtual model (such as ``auto``): rules in order, first match wins, else ``default``."""

    name: ModelName
    rules: list[Rule] = Field(default_factory=list)
    default: ModelName
    compare_to: ModelName | None = Field(
        default=None, description="The model whose estimated cost the decision trace compares the chosen one "
        "with (default: the most expensive model the route can choose).")
