"""The Files API's files: uploaded JSONL input files and the output and error files batches write.

Files live in the database, so every replica can read them, and belong to one tenant: every lookup
is scoped to the tenant, and another tenant's ids are simply not found (never "forbidden").
Functions take the caller's session and do not commit. ``now`` is a timezone-aware datetime or Unix
seconds.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import insert, select
from sqlmodel import Session

from switchyard.store.batch_tables import FILES, Now, keyset_after, rows_changed, utc
from switchyard.store.errors import InvalidParam, NotFound, TooLarge

#: Most requests (lines) in one file, and so in one batch.
MAX_LINES = 50_000
#: Largest file by default (``Settings.batch_max_file_bytes``).
DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
#: Purposes a file can be uploaded with; ``batch_output`` is what batches write.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
MAX_FILENAME = 255


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A stored file, without its content."""

    id: str
    tenant_id: int
    purpose: str
    filename: str
    size: int  # bytes
    created_at: datetime


def jsonl_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a JSONL file with their 1-based line numbers (what counts as its requests)."""
    for number, raw in enumerate(content.split(b"\n"), 1):
        line = raw.strip()
        if line:
            yield number, line


def _file_info(row: Any) -> FileInfo:
    return FileInfo(id=row.id, tenant_id=row.tenant_id, purpose=row.purpose, filename=row.filename, size=row.size,
                    created_at=row.created_at)


_FILE_COLUMNS = (FILES.c.id, FILES.c.tenant_id, FILES.c.purpose, FILES.c.filename, FILES.c.size,
                 FILES.c.created_at)


def insert_file(session: Session, tenant_id: int, purpose: str, filename: str, content: bytes,
                at: datetime) -> FileInfo:
    """Store a file as it is, without an upload's checks (what a batch's output and error files are
    written with)."""
    file_id = "file-" + secrets.token_hex(12)
    session.execute(insert(FILES).values(id=file_id, tenant_id=tenant_id, purpose=purpose, filename=filename,
                                         size=len(content), content=content, created_at=at))
    return FileInfo(id=file_id, tenant_id=tenant_id, purpose=purpose, filename=filename, size=len(content),
                    created_at=at)


def create_file(session: Session, tenant_id: int, filename: str, content: bytes, purpose: str = "batch", *,
                max_bytes: int = DEFAULT_MAX_FILE_BYTES, now: Now | None = None) -> FileInfo:
    """Store an uploaded file of ``tenant_id``.

    Raises:
        InvalidParam: a purpose other than ``batch``, a bad filename, or more than
            :data:`MAX_LINES` lines (``param`` says which).
        TooLarge: the content is larger than ``max_bytes``.
    """
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidParam(f"Unsupported purpose {purpose!r}: files can be uploaded for "
                           f"{', '.join(UPLOAD_PURPOSES)} only.", "purpose")
    if len(content) > max_bytes:
        raise TooLarge(f"The file is {len(content)} bytes; at most {max_bytes} are accepted.")
    filename = filename.strip() or "upload.jsonl"
    if len(filename) > MAX_FILENAME:
        raise InvalidParam(f"The filename is longer than {MAX_FILENAME} characters.", "file")
    lines = sum(1 for _ in jsonl_lines(content))
    if lines > MAX_LINES:
        raise InvalidParam(f"The file has {lines} requests; a batch holds at most {MAX_LINES}.", "file")
    return insert_file(session, tenant_id, purpose, filename, content, utc(now))


def get_file(session: Session, tenant_id: int, file_id: str) -> FileInfo:
    """File ``file_id`` of ``tenant_id`` (without its content).

    Raises:
        NotFound: no such file of this tenant.
    """
    row = session.execute(select(*_FILE_COLUMNS).where(FILES.c.id == file_id,
                                                       FILES.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFound(f"No such File object: {file_id}")
    return _file_info(row)


def file_content(session: Session, tenant_id: int, file_id: str) -> tuple[FileInfo, bytes]:
    """File ``file_id`` of ``tenant_id`` and its content.

    Raises:
        NotFound: no such file of this tenant.
    """
    row = session.execute(select(*_FILE_COLUMNS, FILES.c.content).where(
        FILES.c.id == file_id, FILES.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFound(f"No such File object: {file_id}")
    return _file_info(row), bytes(row.content)


def list_files(session: Session, tenant_id: int, *, purpose: str | None = None, after: str | None = None,
               limit: int = 10_000, order: Literal["asc", "desc"] = "desc") -> tuple[list[FileInfo], bool]:
    """``tenant_id``'s files by creation time, at most ``limit`` after the file ``after``; and
    whether more follow.

    Raises:
        NotFound: ``after`` is not a file of this tenant.
    """
    descending = order == "desc"
    query = select(*_FILE_COLUMNS).where(FILES.c.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(FILES.c.purpose == purpose)
    if after is not None:
        query = query.where(keyset_after(FILES, get_file(session, tenant_id, after), descending))
    keys = (FILES.c.created_at, FILES.c.id)
    query = query.order_by(*(k.desc() for k in keys) if descending else keys).limit(limit + 1)
    rows = session.execute(query).all()
    return [_file_info(row) for row in rows[:limit]], len(rows) > limit


def delete_file(session: Session, tenant_id: int, file_id: str) -> None:
    """Delete file ``file_id`` of ``tenant_id`` (batches made from it keep their lines).

    Raises:
        NotFound: no such file of this tenant.
    """
    deleted = session.execute(FILES.delete().where(FILES.c.id == file_id, FILES.c.tenant_id == tenant_id))
    if rows_changed(deleted) == 0:
        raise NotFound(f"No such File object: {file_id}")
