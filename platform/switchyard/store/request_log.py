"""The request log: finished requests in the database, sampled, kept ``retention_days``.

The gateway hands each finished request to :meth:`RequestLogWriter.offer` on the hot path (its
record appended to a bounded buffer; nothing touches the database there, and the record is read
only when written, so a stream's usage, counted just after it ends, is in); a background task writes the
buffer every ``flush_interval_s``, making its rows ready in short chunks with pauses between them
(``FLUSH_CHUNK``: a flush in one go stalled the event loop), and deletes rows older than the retention every
``PRUNE_EVERY_S``. Successful requests are kept at ``sample_rate`` (chosen at random); every
request that did not succeed is kept, since those are what an operator looks for. A buffer that
fills while the database is away drops its oldest entries (counted in ``dropped``) rather than grow.

Entries hold ids, names, statuses, timings, token counts, the decision trace and a 64-bit
fingerprint of the request (so that a replay knows which requests repeated) — never a key, a
prompt or an answer. Every replica writes to the one table, so the console shows them all.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import operator
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import anyio.to_thread
import msgspec
from sqlalchemy import BigInteger, Engine, Integer, Table, create_engine, delete, event, or_
from sqlmodel import Session, col, select

from switchyard.store.models import RequestLogEntry

log = logging.getLogger("switchyard.request_log")

_TABLE: Table = RequestLogEntry.__table__  # type: ignore[attr-defined]
#: How often rows past the retention are deleted.
PRUNE_EVERY_S = 600.0
#: Entries buffered at most between flushes.
BUFFER = 20_000
#: Rows the gateway's periodic flush makes ready before it pauses for :data:`FLUSH_PAUSE_S`. A flush runs in a
#: worker thread of the gateway's process and making its rows ready is Python work (the record's columns, its trace
#: put into words: about 12 µs a row); while it runs, the event loop mostly waits for the GIL (each time the loop
#: lets go of it, at every socket call, the flush may keep it for up to the interpreter's switch interval, 5 ms). A
#: second's requests flushed in one go made the flush the gateway's p99 at 500 requests/s (`switchyard bench
#: --scenario overhead`: added p99 24-30 ms non-streamed, 41-128 ms streamed, against 6.6-7.2 and 5.7-13 ms with
#: the request log off).
FLUSH_CHUNK = 16
#: A periodic flush that finds more rows than this waiting has fallen behind, and makes them ready
#: :data:`BEHIND_CHUNK` at a time. While the event loop is busy, a chunk waits for the GIL as well as for its pause, so
#: chunks of :data:`FLUSH_CHUNK` wrote about 2,000 rows a second: a gateway that served more for longer than the
#: buffer holds lost rows (at saturation on one core, 3,258 requests/s for 31 s, 5,762 of 100,000 rows were
#: dropped). A second's rows at 1,000 requests/s, the most the latency goals are measured at, stay within it.
BEHIND_ROWS = 2_000
#: The rows a flush that has fallen behind makes ready before each pause (four times :data:`FLUSH_CHUNK`: the loop
#: waits longer for the GIL now and then, where its requests already wait for the core).
BEHIND_CHUNK = 64
#: Rows the periodic flush writes in one transaction (:data:`FLUSH_CHUNK` at a time made ready): the database's
#: own work runs without the GIL, and a commit costs about as much as eight rows (CPU a row: 36 µs in transactions
#: of 16, 28 in transactions of 64).
WRITE_ROWS = 64
#: The periodic flush's pause between its chunks: about a half-millisecond chunk in every 2.5 ms, so the loop runs
#: at least four fifths of the time while the request log is written (a second's 1,300 rows take about 0.2 s).
FLUSH_PAUSE_S = 0.002
#: The columns of a row that hold a request record's values as they are (its ``as_dict()`` names them so too).
COLUMNS = ("request_id", "kind", "tenant", "tenant_id", "key_id", "tier", "model", "resolved_model", "served_model",
           "pool", "region", "endpoint", "status", "outcome", "error_code", "stream", "priority", "queue_ms",
           "attempts", "ttft_ms", "duration_ms", "prompt_tokens", "completion_tokens", "cached_tokens", "max_tokens",
           "digest", "deterministic", "cache", "cache_rule", "policy_version", "canary")
#: The columns a row of the log is written with, in the order :meth:`RequestLogWriter._row` gives their values.
INSERT_COLUMNS = (*COLUMNS, "at", "replica", "detail")
#: The longest text each column holds, or the largest integer (None: no limit to keep to).
_LIMITS: dict[str, int | None] = {
    c.name: (2**63 - 1 if isinstance(c.type, BigInteger) else 2**31 - 1) if isinstance(c.type, Integer)
    else getattr(c.type, "length", None) for c in _TABLE.columns}
#: (position in :data:`COLUMNS`, limit) of the columns with a limit.
_LIMITED = [(i, limit) for i, name in enumerate(COLUMNS) if (limit := _LIMITS[name]) is not None]
_DETAIL = msgspec.json.Encoder()
#: The columns of :data:`COLUMNS` that are a record's attribute of the same name, and the two in milliseconds.
_MS_COLUMNS = {"ttft_ms": "ttft_s", "duration_ms": "duration_s"}
#: A record's values for :data:`COLUMNS` in one call: the attributes of those names (the milliseconds' seconds).
_ATTRIBUTES = operator.attrgetter(*(_MS_COLUMNS.get(name, name) for name in COLUMNS))
#: Where the two durations are in :data:`COLUMNS` (seconds there until :meth:`RequestLogWriter._row` converts them).
_MS_AT = [COLUMNS.index(name) for name in _MS_COLUMNS]


class Loggable(Protocol):
    """A finished request's record (``switchyard.gateway.activity.RequestRecord``): the attributes named in
    :data:`_ATTRIBUTES`, ``ttft_s`` and ``duration_s``, ``at`` (epoch seconds) and the detail's."""

    outcome: str | None

    @property
    def at(self) -> float: ...

    @property
    def moved_on(self) -> Sequence[str]: ...

    @property
    def trace(self) -> Sequence[object]: ...

    @property
    def resumes(self) -> int: ...

    @property
    def hedges(self) -> int: ...

    @property
    def shadow(self) -> Mapping[str, Sequence[str | None]] | None: ...


def replica_name() -> str:
    """This process, as the log names it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class RequestLogWriter:
    """Buffers finished requests and writes them in batches (see the module doc)."""

    def __init__(self, engine: Engine, *, sample_rate: float = 1.0, retention_days: float = 7.0,
                 seed: int | None = None) -> None:
        self._engine = engine
        self._inserter = _Inserter(engine)
        self.sample_rate = sample_rate
        self.retention = timedelta(days=retention_days)
        self.replica = replica_name()
        self.dropped = 0
        self._buffer: deque[Loggable] = deque()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._pruned_at = 0.0

    def offer(self, record: Loggable) -> bool:
        """Keep a finished request's ``record`` for the next flush if sampled; whether it was."""
        if record.outcome == "ok" and self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
            return False
        with self._lock:
            if len(self._buffer) >= BUFFER:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append(record)
        return True

    def _row(self, record: Loggable) -> tuple[Any, ...]:
        """The record's values in the order of :data:`INSERT_COLUMNS` (what its ``as_dict()`` holds, read from its
        attributes: the time to the millisecond, the durations in milliseconds to a tenth)."""
        values = list(_ATTRIBUTES(record))
        for i in _MS_AT:  # (as ``as_dict`` has them: milliseconds to a tenth)
            if values[i] is not None:
                values[i] = round(values[i] * 1000, 1)
        for i, limit in _LIMITED:  # most values fit: only those that do not are cut (``_fit``)
            value = values[i]
            kind = value.__class__
            if kind is str:
                if len(value) > limit or "\x00" in value:
                    values[i] = _fit(value, limit)
            elif kind is int and not -limit <= value < limit:
                values[i] = _fit(value, limit)
        at = datetime.fromtimestamp(record.at, UTC)
        detail: dict[str, Any] = {"moved_on": record.moved_on, "trace": [str(line) for line in record.trace],
                                  "resumes": record.resumes, "hedges": record.hedges}
        if record.shadow:
            detail["shadow"] = record.shadow
        values += (at.replace(microsecond=at.microsecond - at.microsecond % 1000), self.replica,
                   _DETAIL.encode(detail).decode())
        return tuple(values)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def flush(self, pause_s: float = 0.0) -> int:
        """Write what is buffered; blocking. Returns the rows written.

        With ``pause_s`` (the gateway's periodic flush), the rows are made ready :data:`FLUSH_CHUNK` at a time
        (:data:`BEHIND_CHUNK` when more than :data:`BEHIND_ROWS` wait) with a pause of ``pause_s`` after each, so that
        the event loop keeps running, and written in transactions of :data:`WRITE_ROWS`; without, in one.

        Raises:
            Whatever the database raised; the rows not written are then kept for the next flush (the oldest
            dropped if the buffer overflows meanwhile).
        """
        with self._lock:
            taken = list(self._buffer)
            self._buffer.clear()
        if not taken:
            return 0
        paced = FLUSH_CHUNK if len(taken) <= BEHIND_ROWS else BEHIND_CHUNK
        chunk = paced if pause_s > 0 else len(taken)
        written = 0
        rows: list[tuple[Any, ...]] = []
        try:
            for start in range(0, len(taken), chunk):
                if start:
                    time.sleep(pause_s)  # the event loop's turn (see FLUSH_CHUNK)
                rows += [self._row(record) for record in taken[start:start + chunk]]
                if len(rows) >= WRITE_ROWS or start + chunk >= len(taken):
                    self._inserter.write(rows)
                    written += len(rows)
                    rows = []
        except BaseException:
            with self._lock:
                rest = taken[written:]
                room = BUFFER - len(self._buffer)
                kept = rest[-room:] if room > 0 else []
                self.dropped += len(rest) - len(kept)
                self._buffer.extendleft(reversed(kept))
            raise
        return len(taken)

    def close(self) -> None:
        """Let go of the writer's own connections (a SQLite file's; see :class:`_Inserter`)."""
        self._inserter.close()

    def prune(self, now: datetime | None = None) -> int:
        """Delete the rows older than the retention; blocking. Returns how many."""
        cutoff = (now or datetime.now(UTC)) - self.retention
        with self._engine.begin() as conn:
            return int(conn.execute(delete(_TABLE).where(_TABLE.c.at < cutoff)).rowcount or 0)

    async def run(self, interval_s: float) -> None:
        """Flush every ``interval_s`` and prune every :data:`PRUNE_EVERY_S` until cancelled; errors are logged."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            try:
                await anyio.to_thread.run_sync(functools.partial(self.flush, FLUSH_PAUSE_S))
                if loop.time() - self._pruned_at >= PRUNE_EVERY_S:
                    self._pruned_at = loop.time()
                    await anyio.to_thread.run_sync(self.prune)
            except Exception as exc:  # the database may be away for a while: keep the rows, try again
                log.warning("request log: writing failed (%s); %d entries wait", exc, self.pending)

    async def aclose(self) -> None:
        """Write what is left (a clean shutdown loses nothing the database takes)."""
        try:
            await anyio.to_thread.run_sync(self.flush)
        except Exception as exc:
            log.warning("request log: the last %d entries could not be written: %s", self.pending, exc)
        finally:
            self.close()


class _Inserter:
    """Writes rows of the request log: the driver's own ``executemany`` of one INSERT made once, the rows as tuples,
    each column's bind processor (the UTC timestamp's) applied by hand, and a commit that does not wait for the
    disk.

    The request log is the gateway's busiest write (a row per request, in a worker thread of the gateway's process
    that takes the GIL from the event loop for its Python work). Through SQLAlchemy's Core ``insert`` with a dict
    per row a row cost about 64 µs of CPU (its parameters' processing, and a synchronous commit); this way, in
    transactions of :data:`WRITE_ROWS`, about 28 µs (the README's step table under ``overhead``).

    Durability: the log is a record of traffic, not of anything a client or an operator wrote, so a commit of its
    rows does not wait for the disk: on PostgreSQL ``SET LOCAL synchronous_commit TO OFF`` (a crash of the server
    may lose the last fraction of a second of rows, never corrupt or half-write one); on a SQLite file the writer
    keeps an engine of its own whose connections run ``synchronous=NORMAL`` (in WAL mode: safe from corruption, a
    power loss may lose the last transactions). Every other write of the database keeps its full durability.
    """

    def __init__(self, engine: Engine) -> None:
        dialect = engine.dialect
        # (SQLite's driver takes ``?``, psycopg's ``%s``; the table's own names, quoted by the dialect.)
        mark = "?" if dialect.paramstyle == "qmark" else "%s"
        quote = dialect.identifier_preparer.quote
        names, marks = ", ".join(quote(c) for c in INSERT_COLUMNS), ", ".join([mark] * len(INSERT_COLUMNS))
        self._sql = f"INSERT INTO {quote(_TABLE.name)} ({names}) VALUES ({marks})"  # noqa: S608
        #: (position, processor) of the columns whose values the driver does not take as they are.
        self._processors = [(i, processor) for i, name in enumerate(INSERT_COLUMNS)
                            if (processor := _TABLE.c[name].type.dialect_impl(dialect).bind_processor(dialect))
                            is not None]
        self._postgresql = dialect.name == "postgresql"
        self._own: Engine | None = None
        if dialect.name == "sqlite" and engine.url.database and engine.url.database != ":memory:":
            self._own = _relaxed_sqlite_engine(engine)
        self._engine = self._own or engine

    def write(self, rows: list[tuple[Any, ...]]) -> None:
        """Insert ``rows`` (values in the order of :data:`INSERT_COLUMNS`) in one transaction."""
        if self._processors:
            processed = []
            for row in rows:
                values = list(row)
                for i, processor in self._processors:
                    values[i] = processor(values[i])
                processed.append(tuple(values))
            rows = processed
        with self._engine.begin() as conn:
            if self._postgresql:
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            conn.exec_driver_sql(self._sql, rows)

    def close(self) -> None:
        if self._own is not None:
            self._own.dispose()


def _relaxed_sqlite_engine(engine: Engine) -> Engine:
    """A second engine on ``engine``'s SQLite file whose connections commit without waiting for the disk
    (``synchronous=NORMAL``; the file is already in WAL mode, which is what makes that safe)."""
    own = create_engine(engine.url, connect_args={"check_same_thread": False, "timeout": 10})

    @event.listens_for(own, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=10000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    return own


def _fit(value: Any, limit: int | None) -> Any:
    """``value`` as its column can hold it: text cut to the column's length, with no NUL (which PostgreSQL
    refuses); an integer within the column's range. What a client sent (the model it asked for, its
    ``max_tokens``) reaches the log as it came, and one row the database refuses would fail every flush
    after it."""
    if limit is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return max(-limit - 1, min(value, limit))
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")[:limit]
    return value


def _as_dict(entry: RequestLogEntry) -> dict[str, Any]:
    """An entry in the shape of a request record's ``as_dict()`` (plus ``replica``)."""
    detail = json.loads(entry.detail)
    row = {name: getattr(entry, name) for name in COLUMNS}
    return row | {"time": entry.at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "replica": entry.replica, "moved_on": detail.get("moved_on", []), "trace": detail.get("trace", []),
                  "resumes": detail.get("resumes", 0), "hedges": detail.get("hedges", 0),
                  "shadow": detail.get("shadow")}


def search(session: Session, *, tenant: str | None = None, model: str | None = None,
           statuses: Sequence[int] | None = None, outcome: str | None = None, status_class: int | None = None,
           limit: int = 100) -> list[dict[str, Any]]:
    """The newest entries first, filtered: ``tenant`` (name or id), ``model`` (asked, resolved or served),
    an exact status among ``statuses``, an ``outcome``, or a ``status_class`` (2 for 2xx ...)."""
    query = select(RequestLogEntry)
    if tenant:
        query = query.where(or_(col(RequestLogEntry.tenant) == tenant,
                                col(RequestLogEntry.tenant_id) == (int(tenant) if tenant.isdigit() else -1)))
    if model:
        query = query.where(or_(col(RequestLogEntry.model) == model, col(RequestLogEntry.resolved_model) == model,
                                col(RequestLogEntry.served_model) == model))
    if statuses:
        query = query.where(col(RequestLogEntry.status).in_(list(statuses)))
    if outcome:
        query = query.where(col(RequestLogEntry.outcome) == outcome)
    if status_class is not None:
        query = query.where(col(RequestLogEntry.status) >= status_class * 100,
                            col(RequestLogEntry.status) < status_class * 100 + 100)
    query = query.order_by(col(RequestLogEntry.at).desc(), col(RequestLogEntry.id).desc()).limit(limit)
    return [_as_dict(e) for e in session.exec(query)]


def find(session: Session, request_id: str) -> dict[str, Any] | None:
    """The newest entry of ``request_id`` (clients may reuse their ids)."""
    entry = session.exec(select(RequestLogEntry).where(col(RequestLogEntry.request_id) == request_id)
                         .order_by(col(RequestLogEntry.id).desc()).limit(1)).first()
    return None if entry is None else _as_dict(entry)
