"""The batches' lines as a lease queue: what batch workers (any number, in any processes) call.

- :func:`claim` takes due ``pending`` lines, and ``running`` ones whose lease ran out (their worker
  died), of batches ``in_progress``; on PostgreSQL with ``FOR UPDATE SKIP LOCKED``, on SQLite
  (one writer at a time) by the same query; either way the claiming ``UPDATE`` re-checks that each
  line is still claimable, so two claimers never get the same line.
- :func:`renew_leases` keeps long lines leased; :func:`release` hands lines back untried.
- :func:`record_result` and :func:`retry_later` change a line only while it is ``running`` under
  the caller's lease: a late result of a lease that moved on is dropped, so each line has exactly
  one result.

Every state change is a conditional ``UPDATE`` (it re-checks the state it expects), so concurrent
callers cannot both make it. Locks are taken batch row first, then its lines, so nothing deadlocks.
Functions take the caller's session and do not commit. Batches end in
:mod:`~switchyard.store.batch_finalize`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, bindparam, exists, or_, select, update
from sqlmodel import Session

from switchyard.store.batch_tables import BATCHES, LINES, Now, on_postgres, rows_changed, utc


@dataclass(frozen=True, slots=True)
class ClaimedRequest:
    """A batch line leased to a worker: what dispatching it needs.

    Attributes:
        id: The line's row id (what :func:`record_result` and the others take).
        batch_id: Its batch.
        tenant_id: The batch's tenant.
        key_id: The API key that created the batch (the line runs as that key).
        endpoint: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` or ``/v1/responses``.
        custom_id: The line's ``custom_id``.
        body: The request body, as in the input file.
        attempts: Tries so far, this one included (1 on the first).
        lease_until: When the lease runs out unless renewed.
    """

    id: int
    batch_id: str
    tenant_id: int
    key_id: int
    endpoint: str
    custom_id: str
    body: dict[str, Any]
    attempts: int
    lease_until: datetime
    #: When the job's completion window ends (a line that cannot run before then is not retried).
    expires_at: datetime | None = None


def _claimable(at: datetime) -> ColumnElement[bool]:
    return or_(and_(LINES.c.state == "pending", LINES.c.next_attempt_at <= at),
               and_(LINES.c.state == "running", LINES.c.lease_until <= at))


def claim(session: Session, owner: str, limit: int, lease_s: float, now: Now,
          *, except_tenants: Iterable[int] = (), tenant: int | None = None) -> list[ClaimedRequest]:
    """Lease up to ``limit`` lines to ``owner`` for ``lease_s`` seconds: due ``pending`` lines (oldest
    due first), then ``running`` lines whose lease ran out, of batches ``in_progress`` and not past
    their expiry — leaving out the jobs of ``except_tenants``, or only those of ``tenant`` (the worker
    paces tenants whose limits had no room). Each becomes ``running`` with ``attempts`` one higher. Two
    claimers never get the same line.
    """
    if limit <= 0:
        return []
    at = utc(now)
    until = at + timedelta(seconds=lease_s)
    open_batch = and_(BATCHES.c.status == "in_progress", BATCHES.c.expires_at > at)
    left_out = sorted(set(except_tenants))
    if left_out:
        open_batch = and_(open_batch, BATCHES.c.tenant_id.notin_(left_out))
    if tenant is not None:
        open_batch = and_(open_batch, BATCHES.c.tenant_id == tenant)
    ids: list[int] = []
    for due, order in ((and_(LINES.c.state == "pending", LINES.c.next_attempt_at <= at), LINES.c.next_attempt_at),
                       (and_(LINES.c.state == "running", LINES.c.lease_until <= at), LINES.c.lease_until)):
        query = (select(LINES.c.id).join(BATCHES, BATCHES.c.id == LINES.c.batch_id).where(open_batch, due)
                 .order_by(order, LINES.c.id).limit(limit - len(ids)))
        if on_postgres(session):
            query = query.with_for_update(skip_locked=True, of=LINES)
        ids += session.execute(query).scalars().all()
        if len(ids) >= limit:
            break
    if not ids:
        return []
    # The conditions again: on SQLite another claimer may have taken some of these since the SELECT,
    # or the batch been cancelled.
    still_open = exists(select(BATCHES.c.id).where(BATCHES.c.id == LINES.c.batch_id, open_batch))
    taken = session.execute(
        update(LINES).where(LINES.c.id.in_(ids), _claimable(at), still_open)
        .values(state="running", lease_owner=owner, lease_until=until, attempts=LINES.c.attempts + 1)
        .returning(LINES.c.id, LINES.c.batch_id, LINES.c.custom_id, LINES.c.body, LINES.c.attempts)
    ).all()
    if not taken:
        return []
    jobs = {row.id: row for row in session.execute(
        select(BATCHES.c.id, BATCHES.c.tenant_id, BATCHES.c.key_id, BATCHES.c.endpoint, BATCHES.c.expires_at)
        .where(BATCHES.c.id.in_({row.batch_id for row in taken})))}
    return sorted((ClaimedRequest(id=row.id, batch_id=row.batch_id, tenant_id=jobs[row.batch_id].tenant_id,
                                  key_id=jobs[row.batch_id].key_id, endpoint=jobs[row.batch_id].endpoint,
                                  custom_id=row.custom_id, body=row.body, attempts=row.attempts, lease_until=until,
                                  expires_at=jobs[row.batch_id].expires_at)
                   for row in taken), key=lambda c: c.id)


def renew_leases(session: Session, owner: str, row_ids: Iterable[int], lease_s: float, now: Now) -> list[int]:
    """Extend ``owner``'s leases on ``row_ids`` to ``now + lease_s``; the ids it still held (a line
    missing from the answer is no longer the owner's: its result would be dropped)."""
    ids = list(row_ids)
    if not ids:
        return []
    until = utc(now) + timedelta(seconds=lease_s)
    held = session.execute(update(LINES).where(LINES.c.id.in_(ids), LINES.c.state == "running",
                                               LINES.c.lease_owner == owner)
                           .values(lease_until=until).returning(LINES.c.id)).scalars().all()
    return sorted(held)


def release(session: Session, owner: str, row_ids: Iterable[int], now: Now | None = None) -> int:
    """Hand ``owner``'s leased lines back untried (a worker stopping or yielding capacity): pending
    again, due at once, and the claim's attempt not counted. Returns how many were still held."""
    ids = list(row_ids)
    if not ids:
        return 0
    result = session.execute(update(LINES).where(LINES.c.id.in_(ids), LINES.c.state == "running",
                                                 LINES.c.lease_owner == owner)
                             .values(state="pending", lease_owner=None, lease_until=None, next_attempt_at=utc(now),
                                     attempts=LINES.c.attempts - 1))
    return rows_changed(result)


def put_back(session: Session, owner: str, lines: Sequence[tuple[int, float, dict[str, Any] | None]], now: Now) -> None:
    """Hand ``owner``'s leased lines back untried, in one statement: each ``(row, delay_s, error)`` pending again,
    due ``delay_s`` after ``now``, its last error kept and the claim's attempt not counted (a line whose model's
    batch lane had no room: it did not fail). Lines no longer held under ``owner``'s lease are left alone."""
    if not lines:
        return
    at = utc(now)
    statement = update(LINES).where(
        LINES.c.id == bindparam("b_id"), LINES.c.state == "running", LINES.c.lease_owner == owner,
    ).values(state="pending", lease_owner=None, lease_until=None,
             next_attempt_at=bindparam("b_due", type_=LINES.c.next_attempt_at.type),
             error=bindparam("b_error", type_=LINES.c.error.type), attempts=LINES.c.attempts - 1)
    session.execute(statement, [{"b_id": row, "b_due": at + timedelta(seconds=delay_s), "b_error": error}
                                for row, delay_s, error in lines])


def _lock_batch_of(session: Session, row_id: int) -> str | None:
    """The id of line ``row_id``'s batch, its row locked on PostgreSQL (batch first, then line)."""
    query = select(BATCHES.c.id).where(
        BATCHES.c.id == select(LINES.c.batch_id).where(LINES.c.id == row_id).scalar_subquery())
    if on_postgres(session):
        query = query.with_for_update(of=BATCHES)
    batch_id: str | None = session.execute(query).scalar_one_or_none()
    return batch_id


def _mine(row_id: int, owner: str) -> ColumnElement[bool]:
    return and_(LINES.c.id == row_id, LINES.c.state == "running", LINES.c.lease_owner == owner)


def _finish(session: Session, batch_id: str, row_id: int, owner: str, status_code: int | None,
            body: dict[str, Any] | None, error: dict[str, Any] | None, request_id: str | None, at: datetime) -> bool:
    succeeded = status_code is not None and 200 <= status_code < 300 and error is None
    result = session.execute(update(LINES).where(_mine(row_id, owner)).values(
        state="succeeded" if succeeded else "failed", status_code=status_code, response=body, error=error,
        request_id=request_id or f"req_{uuid.uuid4().hex}", finished_at=at, lease_until=None))
    if rows_changed(result) != 1:
        return False
    counter = BATCHES.c.completed_count if succeeded else BATCHES.c.failed_count
    session.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values({counter: counter + 1}))
    return True


def record_result(session: Session, row_id: int, owner: str, status_code: int | None, body: dict[str, Any] | None,
                  error: dict[str, Any] | None, now: Now, *, request_id: str | None = None) -> bool:
    """Store line ``row_id``'s result if it is still ``running`` under ``owner``'s lease (also one
    that ran out but nobody claimed since); whether it was stored. A result that is not stored (the
    lease moved on, the line already has a result, its batch was cancelled or expired) is dropped.

    A 2xx ``status_code`` with no ``error`` makes the line ``succeeded`` (in the output file); anything
    else ``failed`` (in the error file): a non-2xx answer as ``response`` with its ``body``, or no
    answer at all (``status_code`` ``None``) with ``error`` ``{"code", "message"}``. The batch's
    ``request_counts`` grow with it. ``request_id`` defaults to a new one.
    """
    batch_id = _lock_batch_of(session, row_id)
    if batch_id is None:
        return False
    return _finish(session, batch_id, row_id, owner, status_code, body, error, request_id, utc(now))


def retry_later(session: Session, row_id: int, owner: str, delay_s: float, error: dict[str, Any] | None, now: Now,
                *, max_attempts: int | None = None, count_attempt: bool = True) -> bool:
    """Put line ``row_id`` back to ``pending``, due in ``delay_s`` seconds (a transient failure; the
    worker picks the backoff), if it is still ``running`` under ``owner``'s lease; whether it was.
    ``error`` is kept as the line's last error. With ``max_attempts``, a line that has had that many
    tries fails for good instead (no response, ``error``), counted as failed. Without ``count_attempt``
    the try is given back (the line waited for its tenant's budget: it did not fail).
    """
    at = utc(now)
    batch_id = _lock_batch_of(session, row_id)
    if batch_id is None:
        return False
    if max_attempts is not None:
        attempts = session.execute(select(LINES.c.attempts).where(_mine(row_id, owner))).scalar_one_or_none()
        if attempts is None:
            return False
        if attempts >= max_attempts:
            return _finish(session, batch_id, row_id, owner, None, None, error, None, at)
    result = session.execute(update(LINES).where(_mine(row_id, owner)).values(
        state="pending", lease_owner=None, lease_until=None, next_attempt_at=at + timedelta(seconds=delay_s),
        error=error, **({} if count_attempt else {"attempts": LINES.c.attempts - 1})))
    return rows_changed(result) == 1
