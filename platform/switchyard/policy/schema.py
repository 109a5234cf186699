"""The policy document's schema (``schema: 1``), as frozen pydantic models.

Field-level rules live with their section (types, ranges, formats, one-section invariants):
:mod:`~switchyard.policy.fleet`, :mod:`~switchyard.policy.routes`, :mod:`~switchyard.policy.tiers`,
:mod:`~switchyard.policy.cache_rules`, :mod:`~switchyard.policy.policy_tests`,
:mod:`~switchyard.policy.routing` and :mod:`~switchyard.policy.resilience`; this module puts the
sections together into the document. Rules that span sections (a model naming an unknown pool, a
fallback cycle, ...) live in :mod:`switchyard.policy.references`, so that every error can still
name its own YAML location.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from switchyard.policy.base import Name, Strict
from switchyard.policy.cache_rules import CacheRule
from switchyard.policy.fleet import Model, Pool
from switchyard.policy.policy_tests import PolicyTest
from switchyard.policy.resilience import Resilience
from switchyard.policy.rollout import Rollout
from switchyard.policy.routes import Route
from switchyard.policy.routing import ClassifierSpec, EndpointProfile
from switchyard.policy.tiers import PriorityClass, Tier

SCHEMA_VERSION = 1


class PolicyDocument(Strict):
    """The whole policy document."""

    schema_: Literal[1] = Field(alias="schema", description="Version of this document's schema.")
    regions: list[Name] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)
    models: list[Model] = Field(min_length=1)
    routes: list[Route] = Field(default_factory=list)
    priorities: dict[Name, PriorityClass] = Field(min_length=1, description="Classes, best first.")
    tiers: list[Tier] = Field(min_length=1)
    cache: list[CacheRule] = Field(default_factory=list)
    classifiers: dict[Name, ClassifierSpec] = Field(
        default_factory=dict, description="Named classifiers that routing rules use (`when: {classifier: NAME}`).")
    endpoint_profiles: dict[Name, EndpointProfile] = Field(
        default_factory=dict, description="Endpoint-picking profiles (filters, weighted scorers, a picker) that "
        "models name in `endpoint_profile`.")
    resilience: Resilience = Field(
        default_factory=Resilience, description="Health probes, circuit breakers, retries, the first-token timeout "
        "and what happens when Redis or the database cannot be reached.")
    tests: list[PolicyTest] = Field(default_factory=list)
    rollout: Rollout | None = Field(
        default=None, description="How this document goes live when the policy file changes (file mode): as a "
        "canary with steps and guardrails instead of at once. Ignored where a version is published by hand.")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
