"""Home regions of tenants and API keys: the region routing prefers for their requests.

A home region is stored as a name only. Whether the active policy has that region is not the
store's business (policies change; a stored name waits for its region); the CLI warns about it.
"""

from __future__ import annotations

import re

from switchyard.store.errors import StoreError

#: How a region is named: the same rule as the policy's names (``policy.base.Name``).
REGION_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
REGION_MAX_LENGTH = 63
_REGION = re.compile(REGION_PATTERN)


def check_region(region: str | None) -> str | None:
    """``region`` if it is a valid region name (``None`` means "no home region").

    Raises:
        StoreError: ``region`` is not a valid region name.
    """
    if region is not None and _REGION.fullmatch(region) is None:
        raise StoreError(f"invalid region {region!r}: a region name starts with a lower-case letter and has "
                         f"only lower-case letters, digits, '-' and '_', at most {REGION_MAX_LENGTH} characters")
    return region
