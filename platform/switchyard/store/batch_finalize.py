"""How batches end: completed, expired or cancelled, each with its output and error files.

:func:`finalize_ready` turns finished, cancelled and expired batches into their output and error
files, built from the lines' rows (one line per ``custom_id``, input order): however often workers
crash, no result appears twice. :func:`finish_cancel` ends a batch being cancelled once none of its
lines runs under a live lease (``cancel_batch`` calls it at once). Each ending is a conditional
``UPDATE`` of the batch row, so exactly one caller makes it. Functions take the caller's session and
do not commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, and_, exists, select, update
from sqlmodel import Session

from switchyard.store.batch_tables import BATCHES, LINES, UNFINISHED, Now, rows_changed, utc
from switchyard.store.files import OUTPUT_PURPOSE, insert_file

#: A line's ``error`` when its batch ended before it ran.
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}
CANCELLED_ERROR = {"code": "batch_cancelled", "message": "This request was not executed: the batch was cancelled."}


def _unfinished(batch_id: str, states: Sequence[str], live_at: datetime | None = None) -> ColumnElement[bool]:
    cond = and_(LINES.c.batch_id == batch_id, LINES.c.state.in_(states))
    if live_at is not None:
        cond = and_(cond, LINES.c.lease_until > live_at)
    return exists(select(LINES.c.id).where(cond))


def _close_unfinished(session: Session, batch_id: str, error: dict[str, Any], at: datetime) -> None:
    """End a cancelled or expired batch's lines that did not run (not counted: request_counts say
    what completed and failed); a late result for one of them is dropped."""
    session.execute(update(LINES).where(LINES.c.batch_id == batch_id, LINES.c.state.in_(UNFINISHED))
                    .values(state="failed", status_code=None, response=None, error=error, finished_at=at,
                            lease_until=None))


def _line_out(row: Any) -> bytes:
    response = None if row.status_code is None else {
        "status_code": row.status_code, "request_id": row.request_id, "body": row.response}
    return msgspec.json.encode({"id": f"batch_req_{row.id}", "custom_id": row.custom_id, "response": response,
                                "error": row.error}) + b"\n"


def _write_files(session: Session, batch_id: str, at: datetime) -> None:
    """Build the batch's output file (succeeded lines) and error file (failed lines), in input order,
    from its rows: one line per ``custom_id``; a file with no lines is not made."""
    tenant_id = session.execute(select(BATCHES.c.tenant_id).where(BATCHES.c.id == batch_id)).scalar_one()
    output, errors = bytearray(), bytearray()
    rows = session.execute(
        select(LINES.c.id, LINES.c.custom_id, LINES.c.state, LINES.c.status_code, LINES.c.request_id,
               LINES.c.response, LINES.c.error)
        .where(LINES.c.batch_id == batch_id).order_by(LINES.c.line_no).execution_options(yield_per=1000))
    for row in rows:
        if row.state == "succeeded":
            output += _line_out(row)
        elif row.state == "failed":
            errors += _line_out(row)
    ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
    for column, content, kind in (("output_file_id", output, "output"), ("error_file_id", errors, "error")):
        if content:
            ids[column] = insert_file(session, tenant_id, OUTPUT_PURPOSE, f"{batch_id}_{kind}.jsonl",
                                      bytes(content), at).id
    session.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values(ids))


def finish_cancel(session: Session, batch_id: str, at: datetime) -> bool:
    """``cancelling`` → ``cancelled`` if no line is running under a live lease: the lines that did not
    run fail with code ``batch_cancelled`` and the batch's files are written. Whether it ended here."""
    moved = session.execute(update(BATCHES).where(
        BATCHES.c.id == batch_id, BATCHES.c.status == "cancelling",
        ~_unfinished(batch_id, ("running",), live_at=at)).values(status="cancelled", cancelled_at=at))
    return _ended(session, moved, batch_id, CANCELLED_ERROR, at)


def _expire(session: Session, batch_id: str, at: datetime) -> bool:
    moved = session.execute(update(BATCHES).where(
        BATCHES.c.id == batch_id, BATCHES.c.status == "in_progress", BATCHES.c.expires_at <= at)
        .values(status="expired", expired_at=at))
    return _ended(session, moved, batch_id, EXPIRED_ERROR, at)


def _ended(session: Session, moved: Any, batch_id: str, error: dict[str, Any], at: datetime) -> bool:
    """After a status update that ends a batch: if it took (``moved`` changed its row), close its
    unfinished lines with ``error`` and write its files."""
    if rows_changed(moved) != 1:
        return False
    _close_unfinished(session, batch_id, error, at)
    _write_files(session, batch_id, at)
    return True


def _complete(session: Session, batch_id: str, at: datetime) -> bool:
    moved = session.execute(update(BATCHES).where(
        BATCHES.c.id == batch_id, BATCHES.c.status == "in_progress",
        ~_unfinished(batch_id, UNFINISHED)).values(status="finalizing", finalizing_at=at))
    if rows_changed(moved) != 1:
        return False
    _write_files(session, batch_id, at)
    session.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values(status="completed", completed_at=at))
    return True


def finalize_ready(session: Session, now: Now) -> list[str]:
    """End every batch that is ready, with its output and error files; the ids of those ended here.

    - ``in_progress`` with no ``pending`` or ``running`` line → ``finalizing`` → ``completed``.
    - ``in_progress`` with lines left past ``expires_at`` → ``expired``: lines that did not finish fail
      with code ``batch_expired`` (in the error file; not in ``request_counts``).
    - ``cancelling`` with no line running under a live lease → ``cancelled``: lines that did not
      run fail with code ``batch_cancelled`` (in the error file; not in ``request_counts``).

    Safe to run in every process at once: each batch is ended by exactly one caller.
    """
    at = utc(now)
    unfinished = exists(select(LINES.c.id).where(LINES.c.batch_id == BATCHES.c.id,
                                                 LINES.c.state.in_(UNFINISHED)))
    live = exists(select(LINES.c.id).where(LINES.c.batch_id == BATCHES.c.id, LINES.c.state == "running",
                                           LINES.c.lease_until > at))
    steps = (
        (_complete, and_(BATCHES.c.status == "in_progress", ~unfinished)),
        (_expire, and_(BATCHES.c.status == "in_progress", BATCHES.c.expires_at <= at)),
        (finish_cancel, and_(BATCHES.c.status == "cancelling", ~live)),
    )
    done: list[str] = []
    for step, ready in steps:
        candidates = session.execute(select(BATCHES.c.id).where(ready).order_by(BATCHES.c.created_at))
        for batch_id in candidates.scalars().all():
            if step(session, batch_id, at):
                done.append(batch_id)
    return done
