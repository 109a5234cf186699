"""Batch jobs of the OpenAI Batch API: their rows, from creation to cancellation, and what
operators read of them.

**A batch** is created from its input file's lines, already validated by the caller
(:mod:`switchyard.batch.intake`), in one transaction: good lines make the batch (``in_progress``)
and one ``batch_request`` row per line; a file with any bad line makes a ``failed`` batch whose
``errors`` name each bad line (OpenAI's shape) and no rows at all. Every lookup by a tenant is
scoped to it: another tenant's batch is simply not found. Workers run the lines through
:mod:`~switchyard.store.batch_queue`; batches end in :mod:`~switchyard.store.batch_finalize`.

Every state change is a conditional ``UPDATE`` (it re-checks the state it expects), so concurrent
callers cannot both make it. Functions take the caller's session and do not commit: the caller's
transaction (``session_scope``) does. ``now`` is a timezone-aware datetime or Unix seconds.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlmodel import Session, col

from switchyard.store.batch_finalize import finish_cancel
from switchyard.store.batch_tables import BATCHES, LINES, Now, keyset_after, utc
from switchyard.store.errors import Conflict, InvalidParam, NotFound
from switchyard.store.models import Batch, BatchRequest, Tenant

#: The endpoints a batch's lines can call.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: Completion windows (OpenAI accepts only ``24h``).
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}


@dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a batch's input file, validated: what its ``batch_request`` row is made of.

    Attributes:
        line_no: Its 1-based line number in the file (the output and error files keep this order).
        custom_id: The line's ``custom_id`` (unique in its batch).
        body: The request body, as in the file.
    """

    line_no: int
    custom_id: str
    body: dict[str, Any]


def batch_window(endpoint: str, completion_window: str) -> timedelta:
    """How long a batch calling ``endpoint`` has to finish, from its creation to its expiry.

    Raises:
        InvalidParam: batches cannot call ``endpoint``, or ``completion_window`` is not one of
            :data:`COMPLETION_WINDOWS` (``param`` says which).
    """
    if endpoint not in ENDPOINTS:
        raise InvalidParam(f"Unsupported endpoint {endpoint!r}: batches can call {', '.join(ENDPOINTS)}.",
                           "endpoint")
    window = COMPLETION_WINDOWS.get(completion_window)
    if window is None:
        raise InvalidParam(f"Unsupported completion_window {completion_window!r}: only "
                           f"{', '.join(COMPLETION_WINDOWS)} is supported.", "completion_window")
    return window


def create_batch(session: Session, *, tenant_id: int, key_id: int, input_file_id: str, endpoint: str,
                 lines: Sequence[InputLine], errors: Sequence[dict[str, Any]], completion_window: str = "24h",
                 metadata: dict[str, str] | None = None, now: Now | None = None) -> Batch:
    """Store a batch of ``tenant_id`` (made with key ``key_id``) over its file ``input_file_id``, from
    its input as the caller validated it.

    Without ``errors`` the batch is ``in_progress`` with one pending ``batch_request`` per line of
    ``lines``; with ``errors`` (OpenAI's entries, each naming a bad line) it is ``failed``, its
    ``errors`` are those and it has no lines. Either way it is written in the caller's one transaction.

    Raises:
        InvalidParam: an unknown endpoint or completion window.
        ValueError: both ``lines`` and ``errors``, or neither (a refused input has no lines; an
            accepted one has at least one).
    """
    window = batch_window(endpoint, completion_window)
    if bool(lines) == bool(errors):
        raise ValueError("a batch has either lines or errors, not both or neither")
    at = utc(now)
    batch = Batch(id="batch_" + secrets.token_hex(12), tenant_id=tenant_id, key_id=key_id, endpoint=endpoint,
                  input_file_id=input_file_id, completion_window=completion_window, status="validating",
                  user_metadata=metadata,
                  created_at=at, expires_at=at + window)
    if errors:
        batch.status, batch.failed_at = "failed", at
        batch.errors = {"object": "list", "data": list(errors)}
    else:
        batch.status, batch.in_progress_at, batch.total_count = "in_progress", at, len(lines)
    session.add(batch)
    session.flush()
    if lines:
        session.execute(insert(LINES), [
            {"line_no": line.line_no, "custom_id": line.custom_id, "body": line.body, "batch_id": batch.id,
             "state": "pending", "attempts": 0, "next_attempt_at": at} for line in lines])
    return batch


def _load(session: Session, batch_id: str, tenant_id: int | None = None) -> Batch:
    query = select(Batch).where(col(Batch.id) == batch_id)
    if tenant_id is not None:
        query = query.where(col(Batch.tenant_id) == tenant_id)
    batch: Batch | None = session.execute(query.execution_options(populate_existing=True)).scalars().first()
    if batch is None:
        raise NotFound(f"No such Batch object: {batch_id}")
    return batch


def get_batch(session: Session, tenant_id: int, batch_id: str) -> Batch:
    """Batch ``batch_id`` of ``tenant_id``.

    Raises:
        NotFound: no such batch of this tenant.
    """
    return _load(session, batch_id, tenant_id)


def list_batches(session: Session, tenant_id: int, *, after: str | None = None,
                 limit: int = 20) -> tuple[list[Batch], bool]:
    """``tenant_id``'s batches, newest first, at most ``limit`` after the batch ``after``; and whether
    more follow.

    Raises:
        NotFound: ``after`` is not a batch of this tenant.
    """
    query = select(Batch).where(col(Batch.tenant_id) == tenant_id)
    if after is not None:
        query = query.where(keyset_after(BATCHES, _load(session, after, tenant_id), descending=True))
    query = query.order_by(BATCHES.c.created_at.desc(), BATCHES.c.id.desc()).limit(limit + 1)
    found = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    return found[:limit], len(found) > limit


def list_all_batches(session: Session, *, status: str | None = None, tenant_id: int | None = None,
                     before: str | None = None, limit: int = 50) -> tuple[list[tuple[Batch, str]], bool]:
    """Every tenant's batches (for operators), newest first, each with its tenant's name: at most
    ``limit`` older than the batch ``before``, optionally only of one ``status`` or tenant; and whether
    more follow.

    Raises:
        NotFound: ``before`` is not a batch.
    """
    query = select(Batch, col(Tenant.name)).join(Tenant, col(Tenant.id) == col(Batch.tenant_id))
    if status is not None:
        query = query.where(col(Batch.status) == status)
    if tenant_id is not None:
        query = query.where(col(Batch.tenant_id) == tenant_id)
    if before is not None:
        query = query.where(keyset_after(BATCHES, _load(session, before), descending=True))
    query = query.order_by(BATCHES.c.created_at.desc(), BATCHES.c.id.desc()).limit(limit + 1)
    rows = [(batch, str(name)) for batch, name in session.execute(query.execution_options(populate_existing=True))]
    return rows[:limit], len(rows) > limit


def cancel_batch(session: Session, tenant_id: int, batch_id: str, now: Now | None = None) -> Batch:
    """Cancel batch ``batch_id`` of ``tenant_id``: ``in_progress`` → ``cancelling``, and at once
    ``cancelled`` when none of its lines is running (else
    :func:`~switchyard.store.batch_finalize.finalize_ready` does it once they have finished or their
    leases ran out). Cancelling a batch being cancelled changes nothing.

    Raises:
        NotFound: no such batch of this tenant.
        Conflict: the batch has ended otherwise (completed, failed, expired).
    """
    at = utc(now)
    batch = _load(session, batch_id, tenant_id)
    if batch.status == "in_progress":
        session.execute(update(BATCHES).where(BATCHES.c.id == batch_id, BATCHES.c.status == "in_progress")
                        .values(status="cancelling", cancelling_at=at))
        finish_cancel(session, batch_id, at)
        batch = _load(session, batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise Conflict(f"Cannot cancel a batch with status {batch.status!r}.")
    return batch


def request_states(session: Session, batch_id: str) -> dict[str, int]:
    """How many of a batch's lines are in each state (for operators and tests)."""
    rows = session.execute(select(LINES.c.state, func.count()).where(LINES.c.batch_id == batch_id)
                           .group_by(LINES.c.state)).all()
    return {state: int(count) for state, count in rows}


def find_batch(session: Session, batch_id: str) -> tuple[Batch, str] | None:
    """Batch ``batch_id`` of any tenant (for operators) with its tenant's name; ``None``: no such batch."""
    query = (select(Batch, col(Tenant.name)).join(Tenant, col(Tenant.id) == col(Batch.tenant_id))
             .where(col(Batch.id) == batch_id))
    row = session.execute(query.execution_options(populate_existing=True)).first()
    return None if row is None else (row[0], str(row[1]))


def failed_lines(session: Session, batch_id: str, limit: int) -> list[BatchRequest]:
    """At most ``limit`` of a batch's failed lines, the most recently finished first (for operators)."""
    query = (select(BatchRequest)
             .where(col(BatchRequest.batch_id) == batch_id, col(BatchRequest.state) == "failed")
             .order_by(col(BatchRequest.finished_at).desc(), col(BatchRequest.id).desc()).limit(limit))
    return list(session.execute(query).scalars())
