"""Which limits a request is charged against, and the estimate it reserves."""

from __future__ import annotations

import pytest

from switchyard.decide.admit import LIMIT_PERIODS, actual_amounts, estimate, expected_output, limit_charges, spend_of
from switchyard.policy import compile_policy
from switchyard.policy.tiers import Limits
from tests.unit.policy.base import base, to_yaml

SNAP = compile_policy(to_yaml(base()))  # free: 1000 tpm, 10000 per day; pro: large 500 tpm
SMALL, LARGE = SNAP.models["small"], SNAP.models["large"]


def test_the_expected_output_is_max_tokens_or_the_default_within_the_models_caps() -> None:
    assert expected_output(SMALL, 100, 50) == 50
    assert expected_output(SMALL, 100, None) == SMALL.default_max_tokens
    assert expected_output(SMALL, 8000, 1000) == 192  # what the 8192-token window leaves
    assert expected_output(SMALL, 9000, 10) == 0


def test_spend_prices_cached_prompt_tokens_at_the_cached_rate() -> None:
    assert spend_of(SMALL, 1000, 100) == pytest.approx((1000 * 0.1 + 100 * 0.2) / 1e6)
    doc = base()
    doc["models"][0]["price"]["cached_input_per_mtok"] = 0.01
    small = compile_policy(to_yaml(doc)).models["small"]
    assert spend_of(small, 1000, 100, cached_tokens=600) == pytest.approx((400 * 0.1 + 600 * 0.01 + 100 * 0.2) / 1e6)


def test_a_tiers_limits_apply_per_tenant_with_their_periods() -> None:
    est = estimate(SMALL, 120, 30)
    charges = limit_charges(SNAP, "free", SMALL, est, tenant="42", key="7")
    assert [(c.key, c.limit, c.unit, c.capacity, c.period_s, c.amount, c.scope) for c in charges] == [
        ("t:42:tokens_per_minute", "tokens_per_minute", "tokens", 1000.0, 60.0, 150.0, "tier free"),
        ("t:42:tokens_per_day", "tokens_per_day", "tokens", 10000.0, 86400.0, 150.0, "tier free"),
    ]
    assert limit_charges(SNAP, "pro", SMALL, est, tenant="1", key="1") == []  # pro: no limits on small


def test_model_limits_tenant_and_key_overrides() -> None:
    est = estimate(LARGE, 100, 100)
    (model,) = limit_charges(SNAP, "pro", LARGE, est, tenant="9", key="3")
    assert (model.key, model.capacity, model.scope) == ("t:9:m:large:tokens_per_minute", 500.0, "tier pro, model large")
    # A tenant override replaces the tier's value for the limits it sets (null: unlimited) ...
    override = Limits.model_validate({"tokens_per_minute": 5000, "tokens_per_day": None})
    charges = limit_charges(SNAP, "free", SMALL, estimate(SMALL, 10, 10), tenant="42", key="7", tenant_limits=override)
    assert [(c.key, c.capacity, c.scope) for c in charges] == [("t:42:tokens_per_minute", 5000.0, "tenant override")]
    # ... and a key's own limits come on top, in buckets of the key.
    key = Limits(requests_per_minute=2, spend_per_month=1.5)
    charges = limit_charges(SNAP, "free", SMALL, estimate(SMALL, 10, 10), tenant="42", key="7", key_limits=key)
    assert [(c.key, c.amount) for c in charges if c.scope == "key override"] == [
        ("k:7:requests_per_minute", 1.0), ("k:7:spend_per_month", pytest.approx(spend_of(SMALL, 10, 10)))]


def test_actual_amounts_count_tokens_requests_and_spend() -> None:
    charges = limit_charges(SNAP, "free", SMALL, estimate(SMALL, 10, 10), tenant="1", key="1",
                            key_limits=Limits(requests_per_minute=5, spend_per_month=2))
    assert actual_amounts(charges, 77, 0.25) == {"t:1:tokens_per_minute": 77.0, "t:1:tokens_per_day": 77.0,
                                                 "k:1:requests_per_minute": 1.0, "k:1:spend_per_month": 0.25}
    assert set(LIMIT_PERIODS) == set(Limits.model_fields)
