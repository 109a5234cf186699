"""Files and batch jobs of the OpenAI Batch API, and the primitives batch workers run their lines with.

**Files** live in the database, so every replica can read them, and belong to one tenant: every
lookup is scoped to the tenant, and another tenant's ids are simply not found (never "forbidden").

**A batch** is validated when it is created, in one transaction: a good input file becomes the
batch (``in_progress``) and one ``batch_request`` row per line; a file with any bad line becomes a
``failed`` batch whose ``errors`` name each bad line (OpenAI's shape) and no rows at all.

**Workers** (any number, in any processes) share the lines through leases:

- :func:`claim` takes due ``pending`` lines, and ``running`` ones whose lease ran out (their worker
  died), of batches ``in_progress``; on PostgreSQL with ``FOR UPDATE SKIP LOCKED``, on SQLite
  (one writer at a time) by the same query; either way the claiming ``UPDATE`` re-checks that each
  line is still claimable, so two claimers never get the same line.
- :func:`renew_leases` keeps long lines leased; :func:`release` hands lines back untried.
- :func:`record_result` and :func:`retry_later` change a line only while it is ``running`` under
  the caller's lease: a late result of a lease that moved on is dropped, so each line has exactly
  one result.
- :func:`finalize_ready` turns finished, cancelled and expired batches into their output and error
  files, built from the rows (one line per ``custom_id``, input order): however often workers
  crash, no result appears twice.

Every state change is a conditional ``UPDATE`` (it re-checks the state it expects), so concurrent
callers cannot both make it. Locks are taken batch row first, then its lines, so nothing deadlocks.
Functions take the caller's session and do not commit: the caller's transaction (``session_scope``)
does. ``now`` is a timezone-aware datetime or Unix seconds.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

import msgspec
from sqlalchemy import ColumnElement, CursorResult, Result, Table, and_, exists, func, insert, or_, select, update
from sqlmodel import Session, col

from switchyard.store.errors import Conflict, NotFound, StoreError
from switchyard.store.models import Batch, BatchFile, BatchRequest, Tenant

#: The endpoints a batch's lines can call.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
#: Completion windows (OpenAI accepts only ``24h``).
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
#: Most requests (lines) in one batch.
MAX_LINES = 50_000
#: Largest file by default (``Settings.batch_max_file_bytes``).
DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
#: Purposes a file can be uploaded with; ``batch_output`` is what batches write.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
#: Most line errors a failed batch lists (one more entry says how many were left out).
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID = 512
MAX_FILENAME = 255
#: OpenAI's metadata limits.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

#: A line's ``error`` when its batch ended before it ran.
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}
CANCELLED_ERROR = {"code": "batch_cancelled", "message": "This request was not executed: the batch was cancelled."}

_FILES: Table = BatchFile.__table__  # type: ignore[attr-defined]
_BATCHES: Table = Batch.__table__  # type: ignore[attr-defined]
_LINES: Table = BatchRequest.__table__  # type: ignore[attr-defined]
_UNFINISHED = ("pending", "running")

Now = datetime | float


class TooLarge(StoreError):
    """A file is larger than allowed."""


class InvalidParam(StoreError):
    """A parameter of a request is invalid; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A stored file, without its content."""

    id: str
    tenant_id: int
    purpose: str
    filename: str
    size: int  # bytes
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ClaimedRequest:
    """A batch line leased to a worker: what dispatching it needs.

    Attributes:
        id: The line's row id (what :func:`record_result` and the others take).
        batch_id: Its batch.
        tenant_id: The batch's tenant.
        key_id: The API key that created the batch (the line runs as that key).
        endpoint: ``/v1/chat/completions`` or ``/v1/completions``.
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


def _at(now: Now | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if isinstance(now, datetime):
        if now.tzinfo is None:
            raise ValueError("naive datetime: give a timezone-aware one")
        return now.astimezone(UTC)
    return datetime.fromtimestamp(now, UTC)


def _changed(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed."""
    return int(cast(CursorResult[Any], result).rowcount)


def _postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


# --- files ---------------------------------------------------------------------------------

def _lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a JSONL file with their 1-based line numbers."""
    for number, raw in enumerate(content.split(b"\n"), 1):
        line = raw.strip()
        if line:
            yield number, line


def _file_info(row: Any) -> FileInfo:
    return FileInfo(id=row.id, tenant_id=row.tenant_id, purpose=row.purpose, filename=row.filename, size=row.size,
                    created_at=row.created_at)


_FILE_COLUMNS = (_FILES.c.id, _FILES.c.tenant_id, _FILES.c.purpose, _FILES.c.filename, _FILES.c.size,
                 _FILES.c.created_at)


def _insert_file(session: Session, tenant_id: int, purpose: str, filename: str, content: bytes,
                 at: datetime) -> FileInfo:
    file_id = "file-" + secrets.token_hex(12)
    session.execute(insert(_FILES).values(id=file_id, tenant_id=tenant_id, purpose=purpose, filename=filename,
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
    lines = sum(1 for _ in _lines(content))
    if lines > MAX_LINES:
        raise InvalidParam(f"The file has {lines} requests; a batch holds at most {MAX_LINES}.", "file")
    return _insert_file(session, tenant_id, purpose, filename, content, _at(now))


def get_file(session: Session, tenant_id: int, file_id: str) -> FileInfo:
    """File ``file_id`` of ``tenant_id`` (without its content).

    Raises:
        NotFound: no such file of this tenant.
    """
    row = session.execute(select(*_FILE_COLUMNS).where(_FILES.c.id == file_id,
                                                       _FILES.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFound(f"No such File object: {file_id}")
    return _file_info(row)


def file_content(session: Session, tenant_id: int, file_id: str) -> tuple[FileInfo, bytes]:
    """File ``file_id`` of ``tenant_id`` and its content.

    Raises:
        NotFound: no such file of this tenant.
    """
    row = session.execute(select(*_FILE_COLUMNS, _FILES.c.content).where(
        _FILES.c.id == file_id, _FILES.c.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFound(f"No such File object: {file_id}")
    return _file_info(row), bytes(row.content)


def _keyset(table: Table, cursor: Any, descending: bool) -> ColumnElement[bool]:
    """Rows after ``cursor`` (a row with ``created_at`` and ``id``) in (created_at, id) order."""
    created, ident = table.c.created_at, table.c.id
    if descending:
        return or_(created < cursor.created_at, and_(created == cursor.created_at, ident < cursor.id))
    return or_(created > cursor.created_at, and_(created == cursor.created_at, ident > cursor.id))


def list_files(session: Session, tenant_id: int, *, purpose: str | None = None, after: str | None = None,
               limit: int = 10_000, order: Literal["asc", "desc"] = "desc") -> tuple[list[FileInfo], bool]:
    """``tenant_id``'s files by creation time, at most ``limit`` after the file ``after``; and
    whether more follow.

    Raises:
        NotFound: ``after`` is not a file of this tenant.
    """
    descending = order == "desc"
    query = select(*_FILE_COLUMNS).where(_FILES.c.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(_FILES.c.purpose == purpose)
    if after is not None:
        query = query.where(_keyset(_FILES, get_file(session, tenant_id, after), descending))
    keys = (_FILES.c.created_at, _FILES.c.id)
    query = query.order_by(*(k.desc() for k in keys) if descending else keys).limit(limit + 1)
    rows = session.execute(query).all()
    return [_file_info(row) for row in rows[:limit]], len(rows) > limit


def delete_file(session: Session, tenant_id: int, file_id: str) -> None:
    """Delete file ``file_id`` of ``tenant_id`` (batches made from it keep their lines).

    Raises:
        NotFound: no such file of this tenant.
    """
    deleted = session.execute(_FILES.delete().where(_FILES.c.id == file_id, _FILES.c.tenant_id == tenant_id))
    if _changed(deleted) == 0:
        raise NotFound(f"No such File object: {file_id}")


# --- batches -------------------------------------------------------------------------------

def check_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata`` if it keeps OpenAI's limits (at most 16 string pairs, keys ≤ 64, values ≤ 512 characters).

    Raises:
        InvalidParam: it does not.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise InvalidParam("metadata must be an object of string keys and string values.", "metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidParam(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed.",
                           "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidParam(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                               f"{MAX_METADATA_VALUE}.", "metadata")
    return dict(metadata)


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _check_line(line: Any, number: int, endpoint: str, seen: dict[str, int]) -> dict[str, Any] | None:
    """The first thing wrong with one parsed line (OpenAI's error entry), or ``None``."""
    if not isinstance(line, dict):
        return _error("invalid_json_line", "This line is not a JSON object.", None, number)
    custom_id = line.get("custom_id")
    if custom_id is None:
        return _error("missing_required_parameter", "Missing required parameter: custom_id.", "custom_id", number)
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return _error("invalid_value", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                      "characters.", "custom_id", number)
    first = seen.setdefault(custom_id, number)
    if first != number:
        return _error("duplicate_custom_id", f"The custom_id {custom_id!r} is also used on line {first}; each "
                      "request in a batch needs a unique custom_id.", "custom_id", number)
    for field in ("method", "url", "body"):
        if field not in line:
            return _error("missing_required_parameter", f"Missing required parameter: {field}.", field, number)
    if line["method"] != "POST":
        return _error("invalid_value", f"method must be POST, not {line['method']!r}.", "method", number)
    if line["url"] != endpoint:
        return _error("url_mismatch", f"The url {line['url']!r} does not match the batch's endpoint "
                      f"{endpoint!r}.", "url", number)
    body = line["body"]
    if not isinstance(body, dict):
        return _error("invalid_value", "body must be a JSON object.", "body", number)
    model = body.get("model")
    if model is None:
        return _error("missing_required_parameter", "Missing required parameter: body.model.", "body.model",
                      number)
    if not isinstance(model, str) or not model:
        return _error("invalid_value", "body.model must be a non-empty string.", "body.model", number)
    if body.get("stream") is True:
        return _error("invalid_value", "Batch requests cannot stream: remove body.stream.", "body.stream", number)
    return None


def _parse_input(content: bytes, endpoint: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The lines of an input file as rows to insert, or (when any is bad) none and what is wrong."""
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    more = 0
    for count, (number, raw) in enumerate(_lines(content), 1):
        if count > MAX_LINES:
            return [], [_error("too_many_tasks", f"The input file has more than {MAX_LINES} requests; a batch "
                               f"holds at most {MAX_LINES}.")]
        try:
            line = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            problem: dict[str, Any] | None = _error("invalid_json_line", "This line is not parseable as valid JSON.",
                                                    None, number)
        else:
            problem = _check_line(line, number, endpoint, seen)
        if problem is None:
            if not errors:  # once a line is bad no row is written: stop collecting them
                rows.append({"line_no": number, "custom_id": line["custom_id"], "body": line["body"]})
        elif len(errors) < MAX_REPORTED_ERRORS:
            errors.append(problem)
        else:
            more += 1
    if more:
        errors.append(_error("too_many_errors", f"{more} more lines have errors; fix those listed and try again."))
    if errors:
        return [], errors
    if not rows:
        return [], [_error("empty_file", "The input file has no requests.")]
    return rows, []


def create_batch(session: Session, *, tenant_id: int, key_id: int, input_file_id: str, endpoint: str,
                 completion_window: str = "24h", metadata: dict[str, str] | None = None,
                 now: Now | None = None) -> Batch:
    """A batch of ``tenant_id`` (made with key ``key_id``) over its file ``input_file_id``.

    The input is validated here: if every line is good the batch is ``in_progress`` with one
    pending ``batch_request`` per line; otherwise it is ``failed``, its ``errors`` list the bad lines
    and it has no lines. Either way it is written in the caller's one transaction.

    Raises:
        NotFound: no such file of this tenant.
        InvalidParam: an unknown endpoint or completion window, bad metadata, or a file whose
            purpose is not ``batch``.
    """
    if endpoint not in ENDPOINTS:
        raise InvalidParam(f"Unsupported endpoint {endpoint!r}: batches can call {', '.join(ENDPOINTS)}.",
                           "endpoint")
    window = COMPLETION_WINDOWS.get(completion_window)
    if window is None:
        raise InvalidParam(f"Unsupported completion_window {completion_window!r}: only "
                           f"{', '.join(COMPLETION_WINDOWS)} is supported.", "completion_window")
    metadata = check_metadata(metadata)
    info, content = file_content(session, tenant_id, input_file_id)
    if info.purpose != "batch":
        raise InvalidParam(f"File {input_file_id} has purpose {info.purpose!r}; a batch's input file must have "
                           "purpose 'batch'.", "input_file_id")
    at = _at(now)
    rows, errors = _parse_input(content, endpoint)
    batch = Batch(id="batch_" + secrets.token_hex(12), tenant_id=tenant_id, key_id=key_id, endpoint=endpoint,
                  input_file_id=input_file_id, completion_window=completion_window, status="validating",
                  user_metadata=metadata,
                  created_at=at, expires_at=at + window)
    if errors:
        batch.status, batch.failed_at = "failed", at
        batch.errors = {"object": "list", "data": errors}
    else:
        batch.status, batch.in_progress_at, batch.total_count = "in_progress", at, len(rows)
    session.add(batch)
    session.flush()
    if rows:
        for row in rows:
            row.update(batch_id=batch.id, state="pending", attempts=0, next_attempt_at=at)
        session.execute(insert(_LINES), rows)
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
        query = query.where(_keyset(_BATCHES, _load(session, after, tenant_id), descending=True))
    query = query.order_by(_BATCHES.c.created_at.desc(), _BATCHES.c.id.desc()).limit(limit + 1)
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
        query = query.where(_keyset(_BATCHES, _load(session, before), descending=True))
    query = query.order_by(_BATCHES.c.created_at.desc(), _BATCHES.c.id.desc()).limit(limit + 1)
    rows = [(batch, str(name)) for batch, name in session.execute(query.execution_options(populate_existing=True))]
    return rows[:limit], len(rows) > limit


def cancel_batch(session: Session, tenant_id: int, batch_id: str, now: Now | None = None) -> Batch:
    """Cancel batch ``batch_id`` of ``tenant_id``: ``in_progress`` → ``cancelling``, and at once
    ``cancelled`` when none of its lines is running (else :func:`finalize_ready` does it once they
    have finished or their leases ran out). Cancelling a batch being cancelled changes nothing.

    Raises:
        NotFound: no such batch of this tenant.
        Conflict: the batch has ended otherwise (completed, failed, expired).
    """
    at = _at(now)
    batch = _load(session, batch_id, tenant_id)
    if batch.status == "in_progress":
        session.execute(update(_BATCHES).where(_BATCHES.c.id == batch_id, _BATCHES.c.status == "in_progress")
                        .values(status="cancelling", cancelling_at=at))
        _finish_cancel(session, batch_id, at)
        batch = _load(session, batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise Conflict(f"Cannot cancel a batch with status {batch.status!r}.")
    return batch


# --- what the workers call -----------------------------------------------------------------

def _claimable(at: datetime) -> ColumnElement[bool]:
    return or_(and_(_LINES.c.state == "pending", _LINES.c.next_attempt_at <= at),
               and_(_LINES.c.state == "running", _LINES.c.lease_until <= at))


def claim(session: Session, owner: str, limit: int, lease_s: float, now: Now) -> list[ClaimedRequest]:
    """Lease up to ``limit`` lines to ``owner`` for ``lease_s`` seconds: due ``pending`` lines (oldest
    due first), then ``running`` lines whose lease ran out, of batches ``in_progress`` and not past
    their expiry. Each becomes ``running`` with ``attempts`` one higher. Two claimers never get the
    same line.
    """
    if limit <= 0:
        return []
    at = _at(now)
    until = at + timedelta(seconds=lease_s)
    open_batch = and_(_BATCHES.c.status == "in_progress", _BATCHES.c.expires_at > at)
    ids: list[int] = []
    for due, order in ((and_(_LINES.c.state == "pending", _LINES.c.next_attempt_at <= at), _LINES.c.next_attempt_at),
                       (and_(_LINES.c.state == "running", _LINES.c.lease_until <= at), _LINES.c.lease_until)):
        query = (select(_LINES.c.id).join(_BATCHES, _BATCHES.c.id == _LINES.c.batch_id).where(open_batch, due)
                 .order_by(order, _LINES.c.id).limit(limit - len(ids)))
        if _postgres(session):
            query = query.with_for_update(skip_locked=True, of=_LINES)
        ids += session.execute(query).scalars().all()
        if len(ids) >= limit:
            break
    if not ids:
        return []
    # The conditions again: on SQLite another claimer may have taken some of these since the SELECT,
    # or the batch been cancelled.
    still_open = exists(select(_BATCHES.c.id).where(_BATCHES.c.id == _LINES.c.batch_id, open_batch))
    taken = session.execute(
        update(_LINES).where(_LINES.c.id.in_(ids), _claimable(at), still_open)
        .values(state="running", lease_owner=owner, lease_until=until, attempts=_LINES.c.attempts + 1)
        .returning(_LINES.c.id, _LINES.c.batch_id, _LINES.c.custom_id, _LINES.c.body, _LINES.c.attempts)
    ).all()
    if not taken:
        return []
    jobs = {row.id: row for row in session.execute(
        select(_BATCHES.c.id, _BATCHES.c.tenant_id, _BATCHES.c.key_id, _BATCHES.c.endpoint)
        .where(_BATCHES.c.id.in_({row.batch_id for row in taken})))}
    return sorted((ClaimedRequest(id=row.id, batch_id=row.batch_id, tenant_id=jobs[row.batch_id].tenant_id,
                                  key_id=jobs[row.batch_id].key_id, endpoint=jobs[row.batch_id].endpoint,
                                  custom_id=row.custom_id, body=row.body, attempts=row.attempts, lease_until=until)
                   for row in taken), key=lambda c: c.id)


def renew_leases(session: Session, owner: str, row_ids: Iterable[int], lease_s: float, now: Now) -> list[int]:
    """Extend ``owner``'s leases on ``row_ids`` to ``now + lease_s``; the ids it still held (a line
    missing from the answer is no longer the owner's: its result would be dropped)."""
    ids = list(row_ids)
    if not ids:
        return []
    until = _at(now) + timedelta(seconds=lease_s)
    held = session.execute(update(_LINES).where(_LINES.c.id.in_(ids), _LINES.c.state == "running",
                                                _LINES.c.lease_owner == owner)
                           .values(lease_until=until).returning(_LINES.c.id)).scalars().all()
    return sorted(held)


def release(session: Session, owner: str, row_ids: Iterable[int], now: Now | None = None) -> int:
    """Hand ``owner``'s leased lines back untried (a worker stopping or yielding capacity): pending
    again, due at once, and the claim's attempt not counted. Returns how many were still held."""
    ids = list(row_ids)
    if not ids:
        return 0
    result = session.execute(update(_LINES).where(_LINES.c.id.in_(ids), _LINES.c.state == "running",
                                                  _LINES.c.lease_owner == owner)
                             .values(state="pending", lease_owner=None, lease_until=None, next_attempt_at=_at(now),
                                     attempts=_LINES.c.attempts - 1))
    return _changed(result)


def _lock_batch_of(session: Session, row_id: int) -> str | None:
    """The id of line ``row_id``'s batch, its row locked on PostgreSQL (batch first, then line)."""
    query = select(_BATCHES.c.id).where(
        _BATCHES.c.id == select(_LINES.c.batch_id).where(_LINES.c.id == row_id).scalar_subquery())
    if _postgres(session):
        query = query.with_for_update(of=_BATCHES)
    batch_id: str | None = session.execute(query).scalar_one_or_none()
    return batch_id


def _mine(row_id: int, owner: str) -> ColumnElement[bool]:
    return and_(_LINES.c.id == row_id, _LINES.c.state == "running", _LINES.c.lease_owner == owner)


def _finish(session: Session, batch_id: str, row_id: int, owner: str, status_code: int | None,
            body: dict[str, Any] | None, error: dict[str, Any] | None, request_id: str | None, at: datetime) -> bool:
    succeeded = status_code is not None and 200 <= status_code < 300 and error is None
    result = session.execute(update(_LINES).where(_mine(row_id, owner)).values(
        state="succeeded" if succeeded else "failed", status_code=status_code, response=body, error=error,
        request_id=request_id or f"req_{uuid.uuid4().hex}", finished_at=at, lease_until=None))
    if _changed(result) != 1:
        return False
    counter = _BATCHES.c.completed_count if succeeded else _BATCHES.c.failed_count
    session.execute(update(_BATCHES).where(_BATCHES.c.id == batch_id).values({counter: counter + 1}))
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
    return _finish(session, batch_id, row_id, owner, status_code, body, error, request_id, _at(now))


def retry_later(session: Session, row_id: int, owner: str, delay_s: float, error: dict[str, Any] | None, now: Now,
                *, max_attempts: int | None = None) -> bool:
    """Put line ``row_id`` back to ``pending``, due in ``delay_s`` seconds (a transient failure; the
    worker picks the backoff), if it is still ``running`` under ``owner``'s lease; whether it was.
    ``error`` is kept as the line's last error. With ``max_attempts``, a line that has had that many
    tries fails for good instead (no response, ``error``), counted as failed.
    """
    at = _at(now)
    batch_id = _lock_batch_of(session, row_id)
    if batch_id is None:
        return False
    if max_attempts is not None:
        attempts = session.execute(select(_LINES.c.attempts).where(_mine(row_id, owner))).scalar_one_or_none()
        if attempts is None:
            return False
        if attempts >= max_attempts:
            return _finish(session, batch_id, row_id, owner, None, None, error, None, at)
    result = session.execute(update(_LINES).where(_mine(row_id, owner)).values(
        state="pending", lease_owner=None, lease_until=None, next_attempt_at=at + timedelta(seconds=delay_s),
        error=error))
    return _changed(result) == 1


def _unfinished(batch_id: str, states: Sequence[str], live_at: datetime | None = None) -> ColumnElement[bool]:
    cond = and_(_LINES.c.batch_id == batch_id, _LINES.c.state.in_(states))
    if live_at is not None:
        cond = and_(cond, _LINES.c.lease_until > live_at)
    return exists(select(_LINES.c.id).where(cond))


def _close_unfinished(session: Session, batch_id: str, error: dict[str, Any], at: datetime) -> None:
    """End a cancelled or expired batch's lines that did not run (not counted: request_counts say
    what completed and failed); a late result for one of them is dropped."""
    session.execute(update(_LINES).where(_LINES.c.batch_id == batch_id, _LINES.c.state.in_(_UNFINISHED))
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
    tenant_id = session.execute(select(_BATCHES.c.tenant_id).where(_BATCHES.c.id == batch_id)).scalar_one()
    output, errors = bytearray(), bytearray()
    rows = session.execute(
        select(_LINES.c.id, _LINES.c.custom_id, _LINES.c.state, _LINES.c.status_code, _LINES.c.request_id,
               _LINES.c.response, _LINES.c.error)
        .where(_LINES.c.batch_id == batch_id).order_by(_LINES.c.line_no).execution_options(yield_per=1000))
    for row in rows:
        if row.state == "succeeded":
            output += _line_out(row)
        elif row.state == "failed":
            errors += _line_out(row)
    ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
    for column, content, kind in (("output_file_id", output, "output"), ("error_file_id", errors, "error")):
        if content:
            ids[column] = _insert_file(session, tenant_id, OUTPUT_PURPOSE, f"{batch_id}_{kind}.jsonl",
                                       bytes(content), at).id
    session.execute(update(_BATCHES).where(_BATCHES.c.id == batch_id).values(ids))


def _finish_cancel(session: Session, batch_id: str, at: datetime) -> bool:
    """``cancelling`` → ``cancelled`` if no line is running under a live lease."""
    moved = session.execute(update(_BATCHES).where(
        _BATCHES.c.id == batch_id, _BATCHES.c.status == "cancelling",
        ~_unfinished(batch_id, ("running",), live_at=at)).values(status="cancelled", cancelled_at=at))
    return _ended(session, moved, batch_id, CANCELLED_ERROR, at)


def _expire(session: Session, batch_id: str, at: datetime) -> bool:
    moved = session.execute(update(_BATCHES).where(
        _BATCHES.c.id == batch_id, _BATCHES.c.status == "in_progress", _BATCHES.c.expires_at <= at)
        .values(status="expired", expired_at=at))
    return _ended(session, moved, batch_id, EXPIRED_ERROR, at)


def _ended(session: Session, moved: Any, batch_id: str, error: dict[str, Any], at: datetime) -> bool:
    """After a status update that ends a batch: if it took (``moved`` changed its row), close its
    unfinished lines with ``error`` and write its files."""
    if _changed(moved) != 1:
        return False
    _close_unfinished(session, batch_id, error, at)
    _write_files(session, batch_id, at)
    return True


def _complete(session: Session, batch_id: str, at: datetime) -> bool:
    moved = session.execute(update(_BATCHES).where(
        _BATCHES.c.id == batch_id, _BATCHES.c.status == "in_progress",
        ~_unfinished(batch_id, _UNFINISHED)).values(status="finalizing", finalizing_at=at))
    if _changed(moved) != 1:
        return False
    _write_files(session, batch_id, at)
    session.execute(update(_BATCHES).where(_BATCHES.c.id == batch_id).values(status="completed", completed_at=at))
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
    at = _at(now)
    unfinished = exists(select(_LINES.c.id).where(_LINES.c.batch_id == _BATCHES.c.id,
                                                  _LINES.c.state.in_(_UNFINISHED)))
    live = exists(select(_LINES.c.id).where(_LINES.c.batch_id == _BATCHES.c.id, _LINES.c.state == "running",
                                            _LINES.c.lease_until > at))
    steps = (
        (_complete, and_(_BATCHES.c.status == "in_progress", ~unfinished)),
        (_expire, and_(_BATCHES.c.status == "in_progress", _BATCHES.c.expires_at <= at)),
        (_finish_cancel, and_(_BATCHES.c.status == "cancelling", ~live)),
    )
    done: list[str] = []
    for step, ready in steps:
        candidates = session.execute(select(_BATCHES.c.id).where(ready).order_by(_BATCHES.c.created_at))
        for batch_id in candidates.scalars().all():
            if step(session, batch_id, at):
                done.append(batch_id)
    return done


def request_states(session: Session, batch_id: str) -> dict[str, int]:
    """How many of a batch's lines are in each state (for operators and tests)."""
    rows = session.execute(select(_LINES.c.state, func.count()).where(_LINES.c.batch_id == batch_id)
                           .group_by(_LINES.c.state)).all()
    return {state: int(count) for state, count in rows}

