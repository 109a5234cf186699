"""Console page: batches of the Batch API, every tenant's.

``/admin/batches`` lists them newest first (filtered by status and tenant, paged back with
``before``) with their request counts and a progress bar; the table polls itself with htmx.
``/admin/batches/{batch_id}`` shows one: its fields, the input lines a refused batch failed on, how
many of its lines are in each state and the last lines that failed; the part that changes polls
itself while the batch runs. ``POST /admin/batches/{batch_id}/cancel`` (operator) cancels it through
the same store function the API uses, audited as ``batch.cancel`` in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from litestar import Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Redirect, Template
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin.common import PageError, in_db
from switchyard.admin.session import console_origin, current_user
from switchyard.api.errors import ApiError
from switchyard.store import errors as store_errors
from switchyard.store.admin_users import RANK
from switchyard.store.audit import append_event
from switchyard.store.batches import cancel_batch, failed_lines, find_batch, list_all_batches, request_states
from switchyard.store.models import BATCH_STATUSES, REQUEST_STATES, Batch, BatchRequest
from switchyard.store.tenants import list_tenants

LIST_TEMPLATE = "admin/batches.html.j2"
DETAIL_TEMPLATE = "admin/batches_detail.html.j2"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: Failed lines the detail page lists (the most recent first).
FAILED_SHOWN = 10
#: Statuses a batch can still move on from (its pages keep polling).
LIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
#: Statuses a batch can be cancelled in (``cancelling`` already is being cancelled).
CANCELLABLE = ("in_progress",)
NONE = "—"




def _url(batch_id: str) -> str:
    return "/admin/batches/" + quote(batch_id, safe="")


def _when(at: datetime | None) -> dict[str, str] | None:
    if at is None:
        return None
    return {"iso": at.isoformat(timespec="seconds").replace("+00:00", "Z"), "text": at.strftime("%Y-%m-%d %H:%M:%S")}


def _progress(batch: Batch) -> dict[str, Any]:
    """The counts and the bar's widths (percent of the total; completed then failed)."""
    total = batch.total_count
    done, failed = batch.completed_count, batch.failed_count
    ok_pct = round(100 * done / total, 1) if total else 0.0
    failed_pct = round(100 * failed / total, 1) if total else 0.0
    finished = round(100 * (done + failed) / total) if total else 0
    label = (f"{done} completed, {failed} failed of {total} requests ({finished}% finished)" if total
             else "no requests")
    return {"completed": done, "failed": failed, "total": total, "ok_pct": ok_pct, "failed_pct": failed_pct,
            "failed_x": ok_pct, "percent": finished, "label": label}


def _badge(batch: Batch) -> dict[str, str]:
    """The status as the console shows it: OpenAI's ``completed`` says nothing of failed lines, so a completed
    batch with failures reads "completed with N failed" (amber; red when every line failed)."""
    failed, total = batch.failed_count, batch.total_count
    if batch.status != "completed" or not failed:
        return {"text": batch.status, "kind": batch.status}
    if failed >= total:
        return {"text": f"completed, all {failed} failed", "kind": "completed-all-failed"}
    return {"text": f"completed with {failed:,} failed", "kind": "completed-with-failures"}


def _row(batch: Batch, tenant: str) -> dict[str, Any]:
    return {"id": batch.id, "href": _url(batch.id), "tenant": tenant, "tenant_id": batch.tenant_id,
            "endpoint": batch.endpoint, "status": batch.status, "badge": _badge(batch),
            "created": _when(batch.created_at),
            "expires": _when(batch.expires_at), "progress": _progress(batch), "input_file_id": batch.input_file_id,
            "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "live": batch.status in LIVE_STATUSES}


def _whole(raw: str, label: str, low: int, high: int) -> int | None:
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise PageError(f"{label}: {raw!r} is not a whole number") from None
    if not low <= value <= high:
        raise PageError(f"{label}: {value} is not between {low} and {high}")
    return value


# --- the list ------------------------------------------------------------------------------------

@dataclass
class _Listing:
    tenants: list[str]
    rows: list[dict[str, Any]]
    more: bool
    error: str | None = None


def _read_list(session: Session, status: str, tenant: str, before: str, limit: int) -> _Listing:
    tenants = {t.name: t.id for t in list_tenants(session)}
    names = list(tenants)
    if tenant and tenant not in tenants:
        return _Listing(names, [], False, f"no tenant named {tenant!r}")
    try:
        found, more = list_all_batches(session, status=status or None, tenant_id=tenants[tenant] if tenant else None,
                                       before=before or None, limit=limit)
    except store_errors.NotFound:
        return _Listing(names, [], False, f"no batch {before!r} to page back from")
    return _Listing(names, [_row(b, name) for b, name in found], more)


@get("/batches", name="admin:batches", include_in_schema=False)
async def batches_page(request: HTMXRequest, db: NamedDependency[Engine], status: FromQuery[str | None] = None,
                       tenant: FromQuery[str | None] = None, limit: FromQuery[str | None] = None,
                       before: FromQuery[str | None] = None) -> Template:
    """Every tenant's batches, newest first (or just the table, for htmx polling); a bad filter is a 400."""
    filters = {"status": (status or "").strip(), "tenant": (tenant or "").strip(), "limit": (limit or "").strip()}
    after = (before or "").strip()
    error: str | None = None
    size = DEFAULT_LIMIT
    try:
        size = _whole(filters["limit"], "Limit", 1, MAX_LIMIT) or DEFAULT_LIMIT
        if filters["status"] and filters["status"] not in BATCH_STATUSES:
            raise PageError(f"unknown status {filters['status']!r}; a batch is one of: {', '.join(BATCH_STATUSES)}")
    except PageError as exc:
        error = exc.message
    listing = await in_db(db, lambda s: _read_list(s, "" if error else filters["status"], filters["tenant"], after,
                                                   size))
    if error is not None:
        listing.rows, listing.more = [], False
    error = error or listing.error
    kept = {k: v for k, v in filters.items() if v}
    query = urlencode({**kept, **({"before": after} if after else {})})
    context: dict[str, Any] = {
        "filters": filters, "filtered": bool(filters["status"] or filters["tenant"]), "error": error,
        "statuses": BATCH_STATUSES, "tenants": listing.tenants, "rows": listing.rows, "before": after,
        "query": query, "default_limit": DEFAULT_LIMIT, "max_limit": MAX_LIMIT,
        "older": "/admin/batches?" + urlencode({**kept, "before": listing.rows[-1]["id"]})
                 if listing.more and listing.rows else None,
        "newest": "/admin/batches" + (f"?{urlencode(kept)}" if kept else "") if after else None,
    }
    if error is None and request.htmx:
        return HTMXTemplate(template_name="admin/partials/_batches_table.html.j2", context=context)
    return Template(template_name=LIST_TEMPLATE, context=context, status_code=400 if error is not None else 200)


# --- one batch -----------------------------------------------------------------------------------

def _failed_text(line: BatchRequest) -> str:
    """What went wrong with a failed line: its error, else the engine's error message, else its status code."""
    if line.error:
        code, message = line.error.get("code"), line.error.get("message")
        return ": ".join(str(p) for p in (code, message) if p) or str(line.error)
    body = line.response or {}
    found = body.get("error") if isinstance(body, dict) else None
    if isinstance(found, dict) and found.get("message"):
        return str(found["message"])
    return f"HTTP {line.status_code}" if line.status_code is not None else NONE


def _read_batch(session: Session, batch_id: str) -> dict[str, Any] | None:
    found = find_batch(session, batch_id)
    if found is None:
        return None
    batch, tenant = found
    states = request_states(session, batch.id)
    failed = failed_lines(session, batch.id, FAILED_SHOWN)
    errors = [{"line": e.get("line"), "code": e.get("code") or NONE, "param": e.get("param") or NONE,
               "message": e.get("message") or NONE}
              for e in (batch.errors or {}).get("data", []) if isinstance(e, dict)]
    times = [(label, _when(getattr(batch, f"{name}_at"))) for label, name in (
        ("Created", "created"), ("In progress", "in_progress"), ("Expires", "expires"), ("Finalizing", "finalizing"),
        ("Completed", "completed"), ("Failed", "failed"), ("Expired", "expired"), ("Cancelling", "cancelling"),
        ("Cancelled", "cancelled"))]
    return _row(batch, tenant) | {
        "completion_window": batch.completion_window, "metadata": batch.user_metadata or {},
        "times": [(label, at) for label, at in times if at is not None], "errors": errors,
        "states": [(state, states.get(state, 0)) for state in REQUEST_STATES],
        "lines": sum(states.values()),
        "failed_lines": [{"custom_id": f.custom_id, "line_no": f.line_no, "status_code": f.status_code,
                          "attempts": f.attempts, "error": _failed_text(f), "finished": _when(f.finished_at)}
                         for f in failed],
        "cancellable": batch.status in CANCELLABLE,
    }


async def _batch_page(request: HTMXRequest, db: Engine, batch_id: str, *, error: str | None = None,
                      status: int = 200) -> Template:
    batch = await in_db(db, lambda s: _read_batch(s, batch_id))
    can_operate = RANK[current_user(request).role] >= RANK["operator"]
    context = {"batch": batch, "batch_id": batch_id, "error": error, "can_operate": can_operate,
               "failed_shown": FAILED_SHOWN}
    if batch is None:
        return Template(template_name=DETAIL_TEMPLATE, status_code=404, context=context)
    if error is None and request.htmx:
        return HTMXTemplate(template_name="admin/partials/_batches_detail.html.j2", context=context)
    return Template(template_name=DETAIL_TEMPLATE, status_code=status, context=context)


@get("/batches/{batch_id:str}", name="admin:batch", include_in_schema=False)
async def batch_page(request: HTMXRequest, db: NamedDependency[Engine], batch_id: FromPath[str]) -> Template:
    """One batch whole (or just its changing part, for htmx polling); 404 when there is no such batch."""
    return await _batch_page(request, db, batch_id)


@post("/batches/{batch_id:str}/cancel", opt={"role": "operator"}, include_in_schema=False)
async def batch_cancel(request: HTMXRequest, db: NamedDependency[Engine], batch_id: FromPath[str]) -> Response[Any]:
    """Cancel a running batch for its tenant (audited as ``batch.cancel``), then back to its page."""
    actor, origin = console_origin(request)

    def cancel(session: Session) -> bool:
        found = find_batch(session, batch_id)
        if found is None:
            return False
        batch, tenant = found
        tenant_id, previous = batch.tenant_id, batch.status
        if previous in ("cancelling", "cancelled"):
            raise PageError(f"batch {batch_id} is already {previous}", 409)
        batch = cancel_batch(session, tenant_id, batch_id)
        append_event(session, actor=actor, origin=origin, action="batch.cancel", target=f"batch:{batch_id}",
                     detail={"tenant": tenant, "previous": previous, "status": batch.status})
        return True

    try:
        found = await in_db(db, cancel)
    except PageError as exc:
        return await _batch_page(request, db, batch_id, error=exc.message, status=exc.status)
    except ApiError as exc:
        if exc.status_code >= 500:
            raise
        status = 409 if isinstance(exc.__context__, store_errors.Conflict) else exc.status_code
        return await _batch_page(request, db, batch_id, error=exc.message, status=status)
    if not found:
        return await _batch_page(request, db, batch_id)  # the 404 page
    return Redirect(path=_url(batch_id), status_code=303)


ROUTES: list[Any] = [batches_page, batch_page, batch_cancel]
