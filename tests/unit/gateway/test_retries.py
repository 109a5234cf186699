"""The retry budget, on an explicit clock."""

from __future__ import annotations

from switchyard.gateway.retries import RetryBudget
from switchyard.policy.resilience import RetrySpec


def test_retries_are_capped_at_a_share_of_requests_plus_a_floor() -> None:
    spec = RetrySpec(budget_ratio=0.2, budget_window=10, min_retries_per_s=0.5)
    budget = RetryBudget()
    for i in range(100):
        budget.request(i * 0.05, spec)  # 100 requests within 5 s
    allowed = sum(budget.allow_retry(5.0, spec) for _ in range(100))
    assert allowed == 25  # 0.2 x 100 + 0.5 x 10
    assert budget.counts(5.0, spec) == (100, 25)


def test_the_budget_refills_as_the_window_slides() -> None:
    spec = RetrySpec(budget_ratio=0.1, budget_window=2, min_retries_per_s=0)
    budget = RetryBudget()
    for _ in range(10):
        budget.request(0.5, spec)
    assert budget.allow_retry(0.5, spec)
    assert not budget.allow_retry(0.6, spec)
    assert budget.counts(2.5, spec) == (0, 0)  # two seconds on, the first second has left the window
    for _ in range(10):
        budget.request(2.5, spec)
    assert budget.allow_retry(2.6, spec)


def test_without_traffic_only_the_floor_allows_retries() -> None:
    spec = RetrySpec(budget_ratio=0.5, budget_window=1, min_retries_per_s=2)
    budget = RetryBudget()
    assert [budget.allow_retry(0.1, spec) for _ in range(3)] == [True, True, False]
