"""Finished requests for the activity recorder's tests (the gateway's and the console's overview)."""

from __future__ import annotations

from typing import Any

from switchyard.gateway.activity import Activity, RequestRecord

T0 = 1_800_000_000.0  # a whole second, so bucket arithmetic in the tests is plain


def finish(activity: Activity, at: float, status: int = 200, *, pool: str | None = "small-us",
           ttft: float | None = None, rid: str = "r", **fields: Any) -> RequestRecord:
    record = activity.begin(rid, "chat", started=0.0, now=at)
    record.pool = pool
    record.ttft_s = ttft
    record.stream = ttft is not None  # (only streams' TTFTs count; a test says otherwise with stream=False)
    record.duration_s = 0.5
    for name, value in fields.items():
        setattr(record, name, value)
    activity.finish(record, status, now=at)
    return record


def rows(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["pool"]: row for row in summary["pools"]}
