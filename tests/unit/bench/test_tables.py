"""Scenario tables and goals: JSON-ready data, and Markdown rendered from that data alone."""

from __future__ import annotations

import json
from typing import Any

from switchyard.bench.report import MISSING, build_report, render_markdown
from switchyard.bench.tables import (
    format_cell,
    goal,
    goal_verdict,
    ms,
    num,
    pct,
    ratio,
    render_goal_row,
    render_goals,
    render_row,
    render_table,
    table,
    text,
)
from tests.unit.bench.helpers import result


def _table() -> dict[str, Any]:
    return table("Latency", [text("arm", "arm"), ms("p99_s", "p99 ms"), pct("ok", "ok %"), num("n", "n", 0),
                             ratio("x", "ratio")],
                 [{"arm": "a|b", "p99_s": 0.0012345, "ok": 0.5, "n": 12, "x": 2.0},
                  {"arm": "c", "p99_s": None}], "a note")


def test_cells_are_formatted_by_their_column() -> None:
    data = _table()
    assert render_row(data, data["rows"][0]) == "| a\\|b | 1.23 | 50.0 | 12 | 2.00x |"
    assert render_row(data, data["rows"][1]) == f"| c | {MISSING} | {MISSING} | {MISSING} | {MISSING} |"
    assert format_cell({"format": "text", "multiplier": 1, "decimals": 0}, "x\ny") == "x y"


def test_a_table_renders_heading_header_rows_and_note() -> None:
    lines = render_table(_table())
    assert lines[0] == "### Latency"
    assert lines[2] == "| arm | p99 ms | ok % | n | ratio |"
    assert lines[-2] == "a note"


def test_tables_survive_a_json_round_trip_unchanged() -> None:
    data = _table()
    assert render_table(json.loads(json.dumps(data))) == render_table(data)


def test_goals_say_met_missed_or_not_measured() -> None:
    met = goal("p99 added", "≤ 2 ms", 0.0015, True, unit="ms", multiplier=1000)
    missed = goal("ratio", "≥ 5x", 3.0, False, unit="x", decimals=1)
    unknown = goal("litellm", "≥ 5x", None, None, note="not measured: --no-litellm")
    assert [goal_verdict(g) for g in (met, missed, unknown)] == ["met", "MISSED", "not measured"]
    assert render_goal_row(met) == "| p99 added | ≤ 2 ms | 1.50 ms | met |  |"
    assert render_goal_row(unknown) == f"| litellm | ≥ 5x | {MISSING} | not measured | not measured: --no-litellm |"
    assert render_goals([]) == []


def test_a_report_carries_goals_and_tables_into_json_and_markdown() -> None:
    data = _table()
    g = goal("p99 added", "≤ 2 ms", 0.0015, True, unit="ms", multiplier=1000)
    report = build_report({"a": [result(0)]}, tables=[data], goals=[g])
    assert report["tables"] == [data]
    assert report["goals"] == [g]
    md = render_markdown(json.loads(json.dumps(report)))
    assert render_goal_row(g) in md
    for row in data["rows"]:
        assert render_row(data, row) in md
    assert md.index("## Goals") < md.index("## Figures") < md.index("## Summary")
