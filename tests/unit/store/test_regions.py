"""Home-region names: their form, on the store's models and in its check."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from switchyard.policy.base import Name
from switchyard.store.errors import StoreError
from switchyard.store.keys import KeyIdentity
from switchyard.store.models import ApiKeyCreate, TenantCreate
from switchyard.store.regions import check_region

GOOD = ["eu-west", "us-east", "a", "ap_south-1", "a" * 63]
BAD = ["", "EU-west", "1eu", "-eu", "eu west", "eu-west\n", "eu.west", "a" * 64, "é"]


@pytest.mark.parametrize("region", [*GOOD, None])
def test_good_regions_pass(region: str | None) -> None:
    assert check_region(region) == region
    assert TenantCreate(name="acme", tier="pro", region=region).region == region
    assert ApiKeyCreate(tenant="acme", region=region).region == region


@pytest.mark.parametrize("region", BAD)
def test_bad_regions_are_refused_with_a_clear_message(region: str) -> None:
    with pytest.raises(StoreError, match=r"invalid region .*starts with a lower-case letter.*at most 63"):
        check_region(region)
    with pytest.raises(ValidationError, match="region"):
        TenantCreate(name="acme", tier="pro", region=region)
    with pytest.raises(ValidationError, match="region"):
        ApiKeyCreate(tenant="acme", region=region)


@pytest.mark.parametrize("region", GOOD + BAD)
def test_a_home_region_is_named_like_a_policy_region(region: str) -> None:
    try:
        TypeAdapter(Name).validate_python(region)
        policy_accepts = True
    except ValidationError:
        policy_accepts = False
    try:
        check_region(region)
        store_accepts = True
    except StoreError:
        store_accepts = False
    assert store_accepts == policy_accepts


def test_region_is_optional_everywhere() -> None:
    assert TenantCreate(name="acme", tier="pro").region is None
    assert KeyIdentity(1, 1, "acme", "pro").region is None
    assert KeyIdentity(1, 1, "acme", "pro", region="eu-west").region == "eu-west"
