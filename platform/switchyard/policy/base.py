"""What every section of the policy document shares: the strict base model and the identifier types.

The sections live in their own modules (:mod:`~switchyard.policy.fleet`, :mod:`~switchyard.policy.routes`,
:mod:`~switchyard.policy.tiers`, :mod:`~switchyard.policy.cache_rules`,
:mod:`~switchyard.policy.policy_tests`); :mod:`switchyard.policy.schema` puts them together.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

# Identifiers of regions, pools, tiers and priority classes: short, lower-case, URL- and
# label-safe (they end up in metric labels and response headers).
Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]

# What clients put in "model". '@' is reserved for "model@region" in fallback chains.
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]


class Strict(BaseModel):
    """Base of every section: unknown keys are errors, parsed documents are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
