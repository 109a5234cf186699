"""Console page: requests.

``/admin/requests`` lists finished requests, newest first, filtered by tenant, model and status;
the table polls itself with htmx. Two sources: ``source=live`` (the default), what this gateway
process finished lately, from its in-memory record (:mod:`switchyard.gateway.activity`: the last
500, gone after a restart; each replica shows its own), and ``source=log``, the request log in the
database (:mod:`switchyard.store.request_log`: every replica's, sampled, kept for its retention,
written about once a second). ``/admin/requests/{request_id}`` shows one whole, with its decision
trace, from memory or else from the log.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Template
from sqlalchemy import Engine

from switchyard.admin.common import in_db
from switchyard.admin.overview import LANES, recent_requests, status_filter
from switchyard.gateway.activity import RECENT, Activity
from switchyard.settings import Settings
from switchyard.store import request_log

#: Rows shown unless ``limit`` says otherwise.
DEFAULT_LIMIT = 100
#: The status filter's choices: (value, label); the filter takes any code or class too.
STATUS_OPTIONS = [
    ("", "any"), ("2xx", "2xx"), ("4xx", "4xx"), ("5xx", "5xx"), ("429", "429"), ("ok", "ok"),
    ("refused", "refused (other 4xx)"), ("limited", "limited (429)"), ("shed", "shed"), ("error", "error"),
    ("client_closed", "client closed (499)"),
]
NONE = "—"


def _text(value: Any) -> str:
    if value is None or value == "":
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.1f}"
    return str(value)


def _models(row: dict[str, Any]) -> str:
    """What was asked for, then what it resolved to and what served it, where those differ."""
    asked = row["model"] or NONE
    chain = [asked]
    for step in (row["resolved_model"], row["served_model"]):
        if step and step != chain[-1]:
            chain.append(step)
    return " → ".join(chain)


def _tokens(row: dict[str, Any]) -> str:
    prompt, completion, cached = row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]
    if prompt is None and completion is None:
        return NONE
    text = f"{_text(prompt)} / {_text(completion)}"
    return text + (f" ({cached} cached)" if cached else "")


def _row(row: dict[str, Any]) -> dict[str, Any]:
    """A record (``as_dict()``) or a request-log entry as the table shows it (never an API key: neither holds one)."""
    tenant = row["tenant"] or NONE
    return row | {
        "href": "/admin/requests/" + quote(row["request_id"], safe=""),
        "clock": row["time"][11:23],
        "tenant_text": tenant,
        "models": _models(row),
        "ttft_text": _text(row["ttft_ms"]),
        "duration_text": _text(row["duration_ms"]),
        "tokens": _tokens(row),
        "cache_text": row["cache"] + (f" ({row['cache_rule']})" if row["cache_rule"] else ""),
    }


def _fields(row: dict[str, Any]) -> list[tuple[str, str]]:
    """Every field of a record, labelled, for the detail page."""
    tenant = row["tenant"]
    if tenant is not None and row["tenant_id"] is not None:
        tenant = f"{tenant} (id {row['tenant_id']})"
    pairs: list[tuple[str, Any]] = [
        ("Time (UTC)", row["time"]), ("Request id", row["request_id"]), ("Kind", row["kind"]),
        ("Stream", row["stream"]), ("Status", row["status"]), ("Outcome", row["outcome"]),
        ("Error code", row["error_code"]), ("Tenant", tenant), ("Key id", row["key_id"]), ("Tier", row["tier"]),
        ("Model asked", row["model"]), ("Resolved model", row["resolved_model"]),
        ("Served model", row["served_model"]), ("Priority class", row["priority"]), ("Pool", row["pool"]),
        ("Region", row["region"]), ("Endpoint", row["endpoint"]), ("Attempts", row["attempts"]),
        ("Queue ms", row["queue_ms"]), ("TTFT ms", row["ttft_ms"]), ("Duration ms", row["duration_ms"]),
        ("Prompt tokens", row["prompt_tokens"]), ("Completion tokens", row["completion_tokens"]),
        ("Cached tokens", row["cached_tokens"]), ("Cache", row["cache"]), ("Cache rule", row["cache_rule"]),
        ("Policy version", f"v{row['policy_version']}" if row.get("policy_version") is not None else None),
    ]
    if row.get("canary") is not None:
        pairs.append(("Canary", row["canary"]))
    if row.get("shadow"):
        pairs.append(("Shadow would differ", "; ".join(f"{name}: {live} → {other}"
                                                       for name, (live, other) in row["shadow"].items())))
    return [(label, _text(value)) for label, value in pairs]


def _limit(text: str | None) -> int:
    """``limit`` from the query: 1 to :data:`RECENT` (empty: :data:`DEFAULT_LIMIT`)."""
    if not text:
        return DEFAULT_LIMIT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= RECENT:
        raise ValueError(f"limit must be a whole number from 1 to {RECENT}; got {text!r}")
    return value


async def _from_log(db: Engine, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """Request-log entries matching the page's filters."""
    status = filters["status"]
    wanted = status_filter(status) if status else None  # raises ValueError for a bad one, as the live view does
    text = status.lower()
    by = ({"status_class": int(text[0])} if text.endswith("xx") else {"statuses": [int(text)]} if text.isdigit()
          else {"outcome": text}) if wanted is not None else {}
    return await in_db(db, lambda s: request_log.search(s, tenant=filters["tenant"] or None,
                                                       model=filters["model"] or None, limit=limit, **by))


def _is_batch_line(row: dict[str, Any]) -> bool:
    """Whether a request-log entry is a batch job's line (the worker names each ``batch_req_<line>``)."""
    return bool(row.get("batch")) or str(row.get("request_id", "")).startswith("batch_req_")


@get("/requests", name="admin:requests", include_in_schema=False)
async def requests_page(request: HTMXRequest, settings: NamedDependency[Settings], db: NamedDependency[Engine],
                        activity: NamedDependency[Activity], tenant: FromQuery[str | None] = None,
                        model: FromQuery[str | None] = None, status: FromQuery[str | None] = None,
                        limit: FromQuery[str | None] = None, source: FromQuery[str | None] = None,
                        lane: FromQuery[str | None] = None) -> Template:
    """The recent requests, filtered (or just the table, for htmx polling); a bad filter is a 400 page."""
    filters = {"tenant": (tenant or "").strip(), "model": (model or "").strip(), "status": (status or "").strip(),
               "limit": (limit or "").strip(), "source": (source or "").strip(), "lane": (lane or "").strip()}
    error: str | None = None
    rows: list[dict[str, Any]] = []
    try:
        if filters["source"] not in ("", "live", "log"):
            raise ValueError(f"source must be live or log; got {filters['source']!r}")
        count = _limit(filters["limit"])
        if filters["lane"] not in ("", *LANES):
            raise ValueError(f"lane must be interactive or batch; got {filters['lane']!r}")
        if filters["source"] == "log":
            rows = [r for r in await _from_log(db, filters, count)
                    if not filters["lane"] or (filters["lane"] == "batch") == _is_batch_line(r)]
        else:
            rows = [r.as_dict() for r in recent_requests(
                activity, tenant=filters["tenant"] or None, model=filters["model"] or None,
                status=filters["status"] or None, limit=count, lane=filters["lane"] or None)]
    except ValueError as exc:
        error = str(exc)
    query = urlencode({k: v for k, v in filters.items() if v})
    context = {"filters": filters, "filtered": any(filters[k] for k in ("tenant", "model", "status", "lane")),
               "from_log": filters["source"] == "log", "logging": settings.request_log,
               "records": [_row(r) for r in rows], "error": error, "query": query, "keep": RECENT,
               "default_limit": DEFAULT_LIMIT, "status_options": STATUS_OPTIONS,
               "known_status": any(value == filters["status"] for value, _ in STATUS_OPTIONS)}
    if error is None and request.htmx:
        return HTMXTemplate(template_name="admin/partials/_requests_table.html.j2", context=context)
    return Template(template_name="admin/requests.html.j2", context=context,
                    status_code=400 if error is not None else 200)


@get("/requests/{request_id:str}", name="admin:request", include_in_schema=False)
async def request_page(db: NamedDependency[Engine], activity: NamedDependency[Activity],
                       request_id: FromPath[str]) -> Template:
    """One request whole: every field, what it moved on from and its decision trace, from this process's
    memory or else from the request log (404 when neither holds it)."""
    record = activity.get(request_id)
    row = record.as_dict() if record is not None else await in_db(db, lambda s: request_log.find(s, request_id))
    if row is None:
        return Template(template_name="admin/requests_detail.html.j2", status_code=404,
                        context={"record": None, "request_id": request_id, "keep": RECENT})
    return Template(template_name="admin/requests_detail.html.j2",
                    context={"record": row, "fields": _fields(row), "models": _models(row),
                             "request_id": request_id, "keep": RECENT})


ROUTES: list[Any] = [requests_page, request_page]
