"""Scenario tables and goals: plain data in ``report.json``, rendered into ``report.md`` from that data.

A scenario's headline figures (added latency per rate, hit ratio against its bound, time to
detect an outage) do not fit the per-arm summary table, so a scenario builds :func:`table` and
:func:`goal` structures. They are stored as they are in ``report.json``, and the Markdown is
rendered from the stored structure alone (:func:`render_table`, :func:`render_goals`), so the
two files cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from switchyard import figures
from switchyard.bench.report import MISSING, format_value

Format = Literal["number", "ratio", "text"]


@dataclass(frozen=True, slots=True)
class Column:
    """One column: which row key it shows and how.

    Attributes:
        key: The row key.
        label: The header (with its unit).
        multiplier: Values are shown times this (1000 for seconds shown as ms).
        decimals: Decimals shown.
        format: ``number``, ``ratio`` (``1.23x``) or ``text`` (as is).
    """

    key: str
    label: str
    multiplier: float = 1.0
    decimals: int = 1
    format: Format = "number"


def text(key: str, label: str) -> Column:
    """A text column."""
    return Column(key, label, format="text")


def ms(key: str, label: str, decimals: int = 2) -> Column:
    """Seconds shown as milliseconds."""
    return Column(key, label, 1000.0, decimals)


def pct(key: str, label: str, decimals: int = 1) -> Column:
    """A fraction shown as a percentage."""
    return Column(key, label, 100.0, decimals)


def num(key: str, label: str, decimals: int = 1) -> Column:
    """A plain number."""
    return Column(key, label, 1.0, decimals)


def ratio(key: str, label: str) -> Column:
    """A ratio shown as ``1.23x``."""
    return Column(key, label, format="ratio")


def table(title: str, columns: Sequence[Column], rows: Sequence[Mapping[str, Any]], note: str = "") -> dict[str, Any]:
    """A table as JSON-ready data (``columns`` describe how ``rows`` are shown)."""
    return {
        "title": title,
        "columns": [{"key": c.key, "label": c.label, "multiplier": c.multiplier, "decimals": c.decimals,
                     "format": c.format} for c in columns],
        "rows": [dict(r) for r in rows],
        "note": note,
    }


def format_cell(column: Mapping[str, Any], value: Any) -> str:
    """One cell as the Markdown shows it."""
    if value is None:
        return MISSING
    kind = column["format"]
    if kind == "text":
        return str(value).replace("|", "\\|").replace("\n", " ")
    if kind == "ratio":
        return figures.ratio(float(value)) if isinstance(value, int | float) else str(value)
    return format_value(value, column["multiplier"], column["decimals"])


def render_row(data: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    """One Markdown row of table ``data``."""
    return "| " + " | ".join(format_cell(c, row.get(c["key"])) for c in data["columns"]) + " |"


def render_table(data: Mapping[str, Any], level: int = 3) -> list[str]:
    """A table's Markdown lines (a heading, the table, its note)."""
    cols = data["columns"]
    lines = [f"{'#' * level} {data['title']}", "", "| " + " | ".join(c["label"] for c in cols) + " |",
             "|" + "---|" * len(cols)]
    lines += [render_row(data, row) for row in data["rows"]]
    if data.get("note"):
        lines += ["", str(data["note"])]
    return [*lines, ""]


def goal(name: str, target: str, value: float | None, met: bool | None, *, unit: str = "", multiplier: float = 1.0,
         decimals: int = 2, note: str = "") -> dict[str, Any]:
    """A goal: what is promised, what was measured, and whether it was met (None: not measured)."""
    return {"goal": name, "target": target, "value": value, "unit": unit, "multiplier": multiplier,
            "decimals": decimals, "met": met, "note": note}


def goal_verdict(g: Mapping[str, Any]) -> str:
    """``met``, ``MISSED`` or ``not measured``."""
    return "not measured" if g["met"] is None else ("met" if g["met"] else "MISSED")


def goal_value(g: Mapping[str, Any]) -> str:
    """The measured value as shown."""
    if g["value"] is None:
        return MISSING
    shown = format_value(g["value"], g["multiplier"], g["decimals"])
    return f"{shown} {g['unit']}".strip()


def render_goal_row(g: Mapping[str, Any]) -> str:
    """One Markdown row of the goals table."""
    cells = [g["goal"], g["target"], goal_value(g), goal_verdict(g), g.get("note") or ""]
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render_goals(goals: Sequence[Mapping[str, Any]], level: int = 2) -> list[str]:
    """The goals table's Markdown lines ('' when there are none)."""
    if not goals:
        return []
    lines = [f"{'#' * level} Goals", "", "| goal | target | measured | verdict | note |", "|---|---|---|---|---|"]
    lines += [render_goal_row(g) for g in goals]
    return [*lines, ""]
