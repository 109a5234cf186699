"""Console page: the audit log, newest first, filtered by action and actor (prefixes), paged back by id."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template
from sqlalchemy import Engine

from switchyard.admin.common import in_db
from switchyard.store.audit import list_events

TEMPLATE = "admin/audit.html.j2"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500


def _whole(raw: str | None, label: str, low: int, high: int) -> tuple[int | None, str | None]:
    """``raw`` as a whole number in [low, high] (None when empty), or an error."""
    if raw is None or not raw.strip():
        return None, None
    try:
        value = int(raw.strip())
    except ValueError:
        return None, f"{label}: {raw!r} is not a whole number"
    if not low <= value <= high:
        return None, f"{label}: {value} is not between {low} and {high}"
    return value, None


@get("/audit", name="admin:audit", include_in_schema=False)
async def audit_page(db: NamedDependency[Engine], action: FromQuery[str | None] = None,
                     actor: FromQuery[str | None] = None, limit: FromQuery[str | None] = None,
                     before: FromQuery[str | None] = None) -> Template:
    """Audit events newest first; ``action`` and ``actor`` filter by prefix, ``before`` pages back (ids below it)."""
    action = (action or "").strip()
    actor = (actor or "").strip()
    size, size_error = _whole(limit, "Limit", 1, MAX_LIMIT)
    before_id, before_error = _whole(before, "Before id", 1, 2**63 - 1)
    error = size_error or before_error
    count = size or DEFAULT_LIMIT
    filters = {"action": action, "actor": actor, "limit": str(size) if size else ""}
    context: dict[str, Any] = {"filters": filters, "error": error, "events": [], "older": None, "newest": None,
                               "max_limit": MAX_LIMIT, "default_limit": DEFAULT_LIMIT, "before": before_id}
    if error is not None:
        return Template(template_name=TEMPLATE, status_code=400, context=context)
    rows = await in_db(db, lambda s: list_events(s, count + 1, action=action or None, actor=actor or None,
                                                 before_id=before_id))
    more = len(rows) > count
    rows = rows[:count]
    kept = {k: v for k, v in filters.items() if v}
    context["events"] = [{"event": e, "fields": detail_fields(e.detail)} for e in rows]
    if more and rows:
        context["older"] = "/admin/audit?" + urlencode({**kept, "before": rows[-1].id})
    if before_id is not None:
        context["newest"] = "/admin/audit" + (f"?{urlencode(kept)}" if kept else "")
    return Template(template_name=TEMPLATE, context=context)


def detail_fields(detail: Any) -> list[tuple[str, str]]:
    """An event's detail as (field, value) pairs for people: keys in order with spaces for underscores, plain
    values as text (none as "none"), lists joined by commas, anything nested as compact JSON."""
    if not isinstance(detail, dict):
        return [] if detail is None else [("detail", _shown(detail))]
    return [(str(key).replace("_", " "), _shown(value)) for key, value in sorted(detail.items())]


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float | str):
        return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else str(value)
    if isinstance(value, list) and all(isinstance(v, int | float | str) for v in value):
        return ", ".join(str(v) for v in value) or "none"
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False, default=str)


ROUTES: list[Any] = [audit_page]
