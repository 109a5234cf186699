"""The ``cache`` section of the policy document: which answers the response cache keeps, and for whom."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from switchyard.policy.base import ModelName, Name, Strict
from switchyard.policy.units import Duration


class CacheMatch(Strict):
    """Which requests a cache rule applies to; an absent list matches everything."""

    models: list[ModelName] | None = Field(default=None, min_length=1)
    routes: list[ModelName] | None = Field(default=None, min_length=1)
    tiers: list[Name] | None = Field(default=None, min_length=1)
    nondeterministic: bool = Field(
        default=False, description="Also cache requests with temperature > 0 and no seed."
    )


class CacheRule(Strict):
    """A response-cache rule: which requests, exact or semantic, for how long, shared how widely."""

    name: str | None = None
    match: CacheMatch = Field(default_factory=CacheMatch)
    mode: Literal["exact", "semantic"] = "exact"
    min_similarity: float | None = Field(
        default=None, gt=0, le=1, description="Semantic rules: the least cosine similarity of the last user turn "
        "to a cached one (in the same conversation context) that counts as a hit.")
    embedding_pool: Name | None = Field(
        default=None, description="Semantic rules: the pool (`task: embed`) that embeds the last user turn.")
    ttl: Duration
    scope: Literal["tenant", "global"] = Field(
        default="tenant", description="`tenant`: entries are served only to the tenant that stored them; `global`: "
        "to every tenant (explicit opt-in, for shared public content).")
    max_entry_bytes: PositiveInt = Field(default=262_144, description="Larger answers are not stored.")
    max_entries: PositiveInt = Field(
        default=10_000, description="Most entries the rule keeps (per gateway process in memory; in Redis, per "
        "deployment); the least recently used go first.")
    hit_charge: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Share of a hit's tokens and price charged to the tenant's limits "
        "and spend (0: a hit is free; its usage is recorded as cached).")

    @model_validator(mode="after")
    def _mode_fields(self) -> CacheRule:
        if self.mode == "semantic":
            if self.min_similarity is None:
                raise ValueError("a semantic rule needs min_similarity")
            if self.embedding_pool is None:
                raise ValueError("a semantic rule needs embedding_pool")
        elif self.min_similarity is not None or self.embedding_pool is not None:
            raise ValueError("min_similarity and embedding_pool apply to mode: semantic only")
        return self
