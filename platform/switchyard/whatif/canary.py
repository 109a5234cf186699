"""A policy canary in the replay: which requests its candidate decides, and who each request was.

A canary's candidate decides the requests of its slice and the active version the rest, as in the gateway
(:meth:`switchyard.gateway.canary.CanaryFollower.choose`): a request outside the canary's scope (``only``:
tiers, the gateway's region, the model asked for) is the active version's; inside it, the request is hashed
by the rollout's ``by`` (tenant, key, session or request id), salted with the canary's id, by the same
functions (:mod:`switchyard.decide.canary`), and falls in the slice when that point is below the step's
percentage.

**Who a request was.** The gateway hashes the tenant's and key's ids and the request id. A replay of the
request log knows them (:func:`switchyard.whatif.logged.log_who`), so it takes the slice the gateway took;
a trace names only tenant labels: its requests are hashed by their caller (the tenant label, or who
``callers`` says it is) and their position in the workload. The session is the request's
``x-session-id`` header, else the body's ``user``, as in the gateway; the log keeps neither, so a logged
request's session is its key (what the gateway hashes a request without a session by).

A shadow canary is replayed as if its candidate served the slice: the replay shows what the slice would
meet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.decide import canary as rules
from switchyard.decide.decision import Caller
from switchyard.policy.rollout import Rollout
from switchyard.policy.snapshot import PolicySnapshot


@dataclass(frozen=True, slots=True)
class Who:
    """Who sent one request, as the gateway identified it (None: not known, the replay's own is used).

    Attributes:
        tenant: The tenant's id.
        key: The API key's id.
        request_id: The request's id.
    """

    tenant: str | None = None
    key: str | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class CanarySlice:
    """Which requests a canary's candidate decides.

    Attributes:
        rollout: The canary's slice (``by``) and scope (``only``).
        percent: The step's percentage.
        salt: The canary's id (what the gateway salts the hash with); a canary yet to start gets its own.
        region: The gateway's region as the scope sees it (None: the replay's gateway region).
    """

    rollout: Rollout
    percent: float
    salt: int = 0
    region: str | None = None

    @classmethod
    def of(cls, rollout: Rollout, salt: int = 0, percent: float | None = None,
           region: str | None = None) -> CanarySlice:
        """The slice of ``rollout`` at ``percent`` (default: its first step's)."""
        return cls(rollout, rollout.stages[0].percent if percent is None else percent, salt, region)

    def role(self, index: int, caller: Caller, gateway_region: str | None, headers: Mapping[str, str],
             body: Mapping[str, Any], who: Who | None = None) -> rules.Role | None:
        """``canary`` (the candidate decides it), ``control`` (in the scope; the active version decides it) or
        None (outside the scope) for request ``index`` of the workload, sent by ``caller`` (``who``: as the gateway
        identified it)."""
        model = body.get("model")
        region = self.region if self.region is not None else gateway_region
        if not rules.in_scope(self.rollout, caller.tier, region, model if isinstance(model, str) else None):
            return None
        who = who or Who()
        subject = rules.subject_of(self.rollout.by, who.tenant or caller.tenant, who.key or caller.key,
                                   rules.session_of(headers, body), who.request_id or f"replay-{index}")
        return "canary" if rules.in_slice(self.salt, self.percent, subject) else "control"

    def describe(self) -> dict[str, Any]:
        """The slice as the report shows it."""
        only = self.rollout.only
        return {"percent": self.percent, "by": self.rollout.by, "salt": self.salt, "shadow": self.rollout.shadow,
                "only": {"tiers": list(only.tiers), "regions": list(only.regions), "models": list(only.models)}}


@dataclass(frozen=True, slots=True)
class ReplayCanary:
    """A canary as one arm of a replay runs it: its candidate, the slice the candidate decides, and the folder
    the candidate's relative ``sim_profile`` paths start from."""

    candidate: PolicySnapshot
    slice: CanarySlice
    base_dir: Path | None = None

    def label(self) -> str:
        """The arm's policy label: ``v8 canary (10% by tenant)``."""
        return f"{self.candidate.label} canary ({self.slice.percent:g}% by {self.slice.rollout.by})"

    def describe(self) -> dict[str, Any]:
        """The canary as the report shows it."""
        return {"candidate": self.candidate.label, "sha256": self.candidate.sha256, **self.slice.describe()}
