"""The compiled policy: an immutable snapshot with the indexes the hot path reads.

A reload builds a new snapshot and swaps one reference; a request reads the snapshot once, at
its start, and carries it to its end.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from switchyard.policy.fleet import Model, Pool
from switchyard.policy.load import parse_policy
from switchyard.policy.routes import Route
from switchyard.policy.schema import PolicyDocument
from switchyard.policy.tiers import PriorityClass, Tier

#: Added to a batch-lane class's default vLLM priority, so that the engine preempts batch work first.
BATCH_ENGINE_PRIORITY = 1000


def policy_sha256(text: str) -> str:
    """The content hash that identifies a policy document's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """A validated policy document plus lookup tables, never mutated after it is built."""

    document: PolicyDocument
    text: str
    sha256: str
    version: int | None
    models: MappingProxyType[str, Model]
    routes: MappingProxyType[str, Route]
    pools: MappingProxyType[str, Pool]
    tiers: MappingProxyType[str, Tier]
    priorities: MappingProxyType[str, PriorityClass]
    model_pools: MappingProxyType[str, tuple[Pool, ...]]
    tier_allows: MappingProxyType[str, frozenset[str]] = field(repr=False)
    engine_priority: MappingProxyType[str, int] = field(repr=False)
    #: Position of each priority class in ``priorities`` (0 is the best class).
    class_rank: MappingProxyType[str, int] = field(repr=False)
    #: What the decisions compile from this document, once per snapshot (``decide`` keeps its endpoint
    #: profiles here): a pure function of the document, filled on first use and never changed after.
    compiled: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def label(self) -> str:
        """How headers and logs name this snapshot: ``v7`` or the short hash if unversioned."""
        return f"v{self.version}" if self.version is not None else self.sha256[:12]

    def allowed(self, tier: Tier, name: str) -> bool:
        """Whether ``tier`` may call the model or route ``name``."""
        allowed = self.tier_allows[tier.name]
        return "*" in allowed or name in allowed

    def with_version(self, version: int) -> PolicySnapshot:
        """The same snapshot, labelled with the version number its store assigned."""
        return build_snapshot(self.document, self.text, version)


def build_snapshot(doc: PolicyDocument, text: str, version: int | None = None) -> PolicySnapshot:
    """Index a validated document."""
    pools = {p.name: p for p in doc.pools}

    def frozen(d: dict[str, Any]) -> MappingProxyType[str, Any]:
        return MappingProxyType(d)

    return PolicySnapshot(
        document=doc,
        text=text,
        sha256=policy_sha256(text),
        version=version,
        models=frozen({m.name: m for m in doc.models}),
        routes=frozen({r.name: r for r in doc.routes}),
        pools=frozen(pools),
        tiers=frozen({t.name: t for t in doc.tiers}),
        priorities=frozen(dict(doc.priorities)),
        model_pools=frozen({m.name: tuple(pools[p] for p in m.pools) for m in doc.models}),
        tier_allows=frozen({t.name: frozenset(t.models) for t in doc.tiers}),
        engine_priority=frozen({
            name: cls.engine_priority if cls.engine_priority is not None
            else 10 * i + (BATCH_ENGINE_PRIORITY if cls.lane == "batch" else 0)
            for i, (name, cls) in enumerate(doc.priorities.items())
        }),
        class_rank=frozen({name: i for i, name in enumerate(doc.priorities)}),
    )


def compile_policy(text: str, source: str = "<policy>", version: int | None = None) -> PolicySnapshot:
    """Validate YAML text and compile it to a snapshot.

    Raises:
        PolicyError: the document is invalid; nothing was built.
    """
    return build_snapshot(parse_policy(text, source), text, version)
