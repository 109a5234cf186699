"""What the modules of the Batch API's store share: its three tables as SQLAlchemy Core handles
(files, batches, and the batches' lines), the moment a call happens at, and the small helpers of
their queries.

The store's Batch API modules are :mod:`~switchyard.store.files` (the Files API),
:mod:`~switchyard.store.batches` (batch jobs), :mod:`~switchyard.store.batch_queue` (the lines'
lease queue, what workers call) and :mod:`~switchyard.store.batch_finalize` (a batch's end and its
output and error files). Their functions take the caller's session and do not commit: the caller's
transaction (``session_scope``) does.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, Result, Table, and_, or_
from sqlmodel import Session

from switchyard.store.models import Batch, BatchFile, BatchRequest

FILES: Table = BatchFile.__table__  # type: ignore[attr-defined]
BATCHES: Table = Batch.__table__  # type: ignore[attr-defined]
LINES: Table = BatchRequest.__table__  # type: ignore[attr-defined]
#: The states of a line that has no result yet.
UNFINISHED = ("pending", "running")

#: When a call happens: a timezone-aware datetime or Unix seconds.
Now = datetime | float


def utc(now: Now | None) -> datetime:
    """``now`` as a UTC datetime (``None``: the current time).

    Raises:
        ValueError: ``now`` is a naive datetime.
    """
    if now is None:
        return datetime.now(UTC)
    if isinstance(now, datetime):
        if now.tzinfo is None:
            raise ValueError("naive datetime: give a timezone-aware one")
        return now.astimezone(UTC)
    return datetime.fromtimestamp(now, UTC)


def rows_changed(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed."""
    return int(cast(CursorResult[Any], result).rowcount)


def on_postgres(session: Session) -> bool:
    """Whether ``session`` talks to PostgreSQL (row locks there; SQLite has one writer at a time)."""
    return session.get_bind().dialect.name == "postgresql"


def keyset_after(table: Table, cursor: Any, descending: bool) -> ColumnElement[bool]:
    """Rows after ``cursor`` (a row with ``created_at`` and ``id``) in (created_at, id) order."""
    created, ident = table.c.created_at, table.c.id
    if descending:
        return or_(created < cursor.created_at, and_(created == cursor.created_at, ident < cursor.id))
    return or_(created > cursor.created_at, and_(created == cursor.created_at, ident > cursor.id))
