"""Where a request may be served and which region it prefers.

- **Allowed regions**: the tier's ``regions`` (data residency); None when it sets none. Pools
  elsewhere are out of the request's plan and out of flow control's view of its model.
- **Home region**, first that applies: the ``x-switchyard-region`` header (an unknown region is a
  400, one the tier may not use a 403), the API key's region, the tenant's, the gateway's own
  (``SWITCHYARD_REGION``). A stored or configured region that the policy does not declare, or that
  the tier may not use, is passed over (and said so in the trace). The picker prefers home
  endpoints and spills to other regions by the capacity they have left (``decide.pick``).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.api.headers import REGION_HEADER
from switchyard.decide.pick import pools_within
from switchyard.decide.refusals import Refused
from switchyard.policy.fleet import Model
from switchyard.policy.snapshot import PolicySnapshot


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request may go and where it would rather go."""

    allowed: frozenset[str] | None
    home: str | None
    trace: str


def place(snapshot: PolicySnapshot, tier_name: str, model: Model, header: str | None,
          key_region: str | None = None, gateway_region: str | None = None) -> Placement:
    """The request's allowed regions and home region (see the module doc).

    Raises:
        Refused: 400 ``invalid_region`` (the header names no region of the policy), 403
            ``region_not_allowed`` (the header names a region the tier may not use, or no region
            the tier may use has a pool of ``model``).
    """
    tier = snapshot.tiers[tier_name]
    allowed = frozenset(tier.regions) if tier.regions is not None else None
    declared = snapshot.document.regions
    if allowed is not None and not pools_within(snapshot.model_pools[model.name], allowed):
        raise Refused(403, "region_not_allowed",
                      f"Tier '{tier.name}' may be served in {', '.join(sorted(allowed))} only, and model "
                      f"`{model.name}` has no pool there.", "model")
    skipped = []
    home: str | None = None
    source = ""
    if header:
        if header not in declared:
            raise Refused(400, "invalid_region",
                          f"Header {REGION_HEADER}: unknown region '{header[:64]}'; the policy's regions are "
                          f"{', '.join(declared)}.", REGION_HEADER)
        if allowed is not None and header not in allowed:
            raise Refused(403, "region_not_allowed",
                          f"Header {REGION_HEADER}: tier '{tier.name}' may not be served in '{header}' (only in "
                          f"{', '.join(sorted(allowed))}).", REGION_HEADER)
        home, source = header, "header"
    else:
        for region, where in ((key_region, "key or tenant"), (gateway_region, "gateway")):
            if region is None:
                continue
            if region not in declared or (allowed is not None and region not in allowed):
                skipped.append(f"{where} region {region} passed over ("
                               + ("not in the policy" if region not in declared else "not allowed for the tier")
                               + ")")
                continue
            home, source = region, where
            break
    parts = [f"home region {home} (from the {source})" if home else "no home region"]
    if allowed is not None:
        parts.append(f"allowed: {', '.join(sorted(allowed))}")
    return Placement(allowed, home, "; ".join(parts + skipped))
