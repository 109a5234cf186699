"""The usage chart spans the days with data (at least a week), not the whole window asked for."""

from __future__ import annotations

from datetime import date, timedelta

from switchyard.admin.pages.usage import Sums, with_data


def _days(n: int, data_at: set[int]) -> list[tuple[date, Sums]]:
    start = date(2027, 1, 1)
    return [(start + timedelta(days=i), Sums(requests=1, prompt_tokens=5) if i in data_at else Sums())
            for i in range(n)]


def test_leading_empty_days_are_left_out_down_to_a_week() -> None:
    assert [d.day for d, _ in with_data(_days(30, {28, 29}))] == list(range(24, 31))
    assert len(with_data(_days(30, {5}))) == 25  # from the first day with data on
    assert len(with_data(_days(30, set()))) == 7  # an empty ledger: the last week
    assert len(with_data(_days(3, set()))) == 3
