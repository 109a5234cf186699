"""Console page: usage over time, from the usage ledger (per UTC day, tenant, key and model).

``/admin/usage?tenant=&model=&days=30`` shows tokens (prompt, completion, cached), requests and
spend per day, per tenant and per model, their totals, and a bar chart per day drawn on the
server as SVG (the console's Content-Security-Policy allows no script to draw one). The filter is
a plain GET form; with htmx only the results are swapped in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Template
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin.common import in_db
from switchyard.api.errors import ApiError
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.settings import Settings
from switchyard.store.models import UsageCounts, UsageDailyPublic, UsageReport
from switchyard.store.tenants import list_tenants
from switchyard.store.usage import usage

DEFAULT_DAYS = 30
MAX_DAYS = 366

#: The chart's drawing area, in SVG user units (it scales to the page width).
CHART_WIDTH = 720
CHART_HEIGHT = 180
CHART_LEFT = 56  # room for the axis labels
CHART_BOTTOM = 22
CHART_TOP = 10  # room for the top axis label


@dataclass(slots=True)
class Sums:
    """Counts summed over some ledger rows."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spend: float = 0.0

    def add(self, row: UsageDailyPublic) -> None:
        self.requests += row.requests
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.cached_tokens += row.cached_tokens
        self.spend += row.spend

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _grouped(rows: list[UsageDailyPublic], key: str) -> list[tuple[str, Sums]]:
    groups: dict[str, Sums] = {}
    for row in rows:
        groups.setdefault(str(getattr(row, key)), Sums()).add(row)
    return sorted(groups.items())


def _nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``value`` (the chart's top)."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= value:
                return m * step
        step *= 10


def _short(n: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.0f}"


def chart(days: list[tuple[date, Sums]]) -> dict[str, Any]:
    """Bars per day (prompt tokens, uncached and cached, and completion tokens stacked), in SVG units."""
    top = _nice_ceiling(max((s.tokens for _, s in days), default=0) or 1)
    plot_w = CHART_WIDTH - CHART_LEFT
    plot_h = CHART_HEIGHT - CHART_BOTTOM - CHART_TOP
    base_y = CHART_TOP + plot_h
    slot = plot_w / max(1, len(days))
    bar_w = max(1.0, slot * 0.7)
    bars = []
    for i, (day, sums) in enumerate(days):
        x = CHART_LEFT + i * slot + (slot - bar_w) / 2
        y = float(base_y)
        parts = []
        for cls, amount in (("usage-bar-cached", sums.cached_tokens),
                            ("usage-bar-prompt", sums.prompt_tokens - sums.cached_tokens),
                            ("usage-bar-completion", sums.completion_tokens)):
            h = plot_h * max(0, amount) / top
            y -= h
            if h > 0:
                parts.append({"cls": cls, "y": round(y, 2), "height": round(h, 2)})
        label = (f"{day:%Y-%m-%d}: {sums.prompt_tokens:,} prompt ({sums.cached_tokens:,} cached), "
                 f"{sums.completion_tokens:,} completion tokens, {sums.requests:,} requests, spend {sums.spend:,.4f}")
        bars.append({"x": round(x, 2), "width": round(bar_w, 2), "parts": parts, "label": label,
                     "tick": f"{day:%m-%d}" if len(days) <= 14 or i % max(1, len(days) // 10) == 0 else None,
                     "tick_x": round(x + bar_w / 2, 2)})
    grid = [{"y": round(base_y - plot_h * f, 2), "label": _short(top * f)} for f in (0, 0.5, 1)]
    return {"width": CHART_WIDTH, "height": CHART_HEIGHT, "left": CHART_LEFT,
            "bars": bars, "grid": grid, "top": top}


def _read(session: Session, tenant: str | None, model: str | None, since: date,
          until: date) -> tuple[UsageReport, list[str]]:
    tenants = [t.name for t in list_tenants(session)]
    return usage(session, tenant=tenant, model=model, since=since, until=until), tenants


#: The fewest days the chart shows, so that a fresh ledger's one day still reads as a day among others.
MIN_CHART_DAYS = 7


def with_data(days: list[tuple[date, Sums]], least: int = MIN_CHART_DAYS) -> list[tuple[date, Sums]]:
    """The days from the first with data on (the empty days before it would only make the bars thin), at least
    the last ``least`` of them."""
    first = next((i for i, (_, s) in enumerate(days) if s.requests or s.tokens or s.spend), len(days))
    return days[min(first, max(0, len(days) - least)):]


def _days_param(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return DEFAULT_DAYS
    try:
        days = int(raw)
    except ValueError:
        raise ValueError(f"days must be a whole number from 1 to {MAX_DAYS}, not {raw!r}") from None
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(f"days must be a whole number from 1 to {MAX_DAYS}, not {days}")
    return days


@get("/usage", name="admin:usage", include_in_schema=False)
async def usage_page(request: HTMXRequest, settings: NamedDependency[Settings], db: NamedDependency[Engine],
                     policy: NamedDependency[PolicyHolder], tenant: FromQuery[str | None] = None,
                     model: FromQuery[str | None] = None, days: FromQuery[str | None] = None) -> Template:
    """Usage per day, tenant and model over the last ``days`` UTC days (today included)."""
    snapshot = policy.snapshot
    tenant = (tenant or "").strip() or None
    model = (model or "").strip() or None
    error: str | None = None
    status = 200
    try:
        n_days = _days_param(days)
    except ValueError as exc:
        error, status, n_days = str(exc), 400, DEFAULT_DAYS
    until = datetime.now(UTC).date()
    since = until - timedelta(days=n_days - 1)
    report = UsageReport(rows=[], totals=UsageCounts())
    tenants: list[str] = []
    if error is None:
        try:
            report, tenants = await in_db(db, lambda s: _read(s, tenant, model, since, until))
        except ApiError as exc:  # an unknown tenant
            if exc.status_code >= 500:
                raise
            error, status = exc.message, exc.status_code
    if not tenants:
        tenants = await in_db(db, lambda s: [t.name for t in list_tenants(s)])

    per_day: dict[date, Sums] = {since + timedelta(days=i): Sums() for i in range(n_days)}
    for row in report.rows:
        per_day.setdefault(row.day, Sums()).add(row)
    days_list = sorted(per_day.items())
    totals = Sums()
    for row in report.rows:
        totals.add(row)
    models = sorted(set(snapshot.models) | ({model} if model else set()))
    context = {
        "filters": {"tenant": tenant or "", "model": model or "", "days": days if error and days else n_days},
        "since": since, "until": until,
        "tenants": tenants, "models": models,
        "day_rows": [(d, s) for d, s in days_list if s.requests or s.tokens or s.spend],
        "by_tenant": _grouped(report.rows, "tenant"),
        "by_model": _grouped(report.rows, "model"),
        "totals": totals,
        "chart": chart(with_data(days_list)),
        "flush_s": settings.usage_flush_interval_s,
        "error": error,
    }
    if request.htmx and request.htmx.target == "usage-results":
        # htmx swaps only 2xx answers: the error is in the partial (role="alert") instead
        return HTMXTemplate(template_name="admin/partials/_usage_results.html.j2", context=context)
    return Template(template_name="admin/usage.html.j2", context=context, status_code=status)


ROUTES: list[Any] = [usage_page]
