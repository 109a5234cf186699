"""Key changes reach every gateway process's key cache before the call that made them returns.

A gateway caches what a key lookup answered (``gateway/auth.py``). Whatever changes that answer (a
revoked key, a deleted tenant, a new tier, region or limit override) is *announced* by
:func:`announce` in the transaction that makes the change, so that it is heard exactly when it
commits and never when it is rolled back:

- **PostgreSQL**: ``NOTIFY switchyard_keys, '<token> <n> <target>'`` where ``target`` is
  ``key:<id>``, ``tenant:<id>`` and ``n`` counts the transaction's announcements from 0. Every
  gateway process LISTENs on one connection named :data:`LISTENER_NAME` (``application_name``, so a
  revoker can count them in ``pg_stat_activity``); it drops the cached identities of ``target`` and
  answers ``NOTIFY switchyard_keys_ack, '<token> <n>'``. A gateway whose listening connection is not
  up trusts no cached answer (each request is looked up), and on (re)connecting it first answers
  ``'*'`` and then expires its whole cache.
- **SQLite**: the database header's ``user_version`` (``PRAGMA user_version``, written in the same
  transaction after a write has taken the database's write lock) counts announcements. Right after
  such a transaction commits, the process that made it writes 8 fresh random bytes into the *key
  stamp*, a file beside the database (``<database>-keys``, as SQLite keeps ``-wal`` and ``-shm``).
  Each gateway process maps the stamp into its memory and compares it before it answers a request
  from its cache (no system call, and the GIL kept: about 0.1 µs); a stamp it has not seen, or a
  quarter of a second since it last did (:data:`MARKER_RECHECK_S`), has it read ``user_version``
  through a connection of its own, and a number it has not seen expires its cache. The stamp is
  written after the commit, so a process that sees it sees the change; a writer that died between
  its commit and the stamp is caught up with by the recheck. (Reading ``user_version`` on every
  request cost 40-50 µs of the gateway's CPU a request under load: the request log's writes
  invalidate SQLite's page cache, and each read hands the GIL to the log's writer thread.)

:func:`changing_keys` runs a change and, on PostgreSQL, waits until every listening gateway
process confirmed it (at most :data:`ACK_WAIT_S`, then a warning). It LISTENs for the
acknowledgements *and* on ``switchyard_keys`` before the transaction begins, so it sees its own
announcement in the one order PostgreSQL delivers notifications in (commit order): the processes
to wait for are those listening (``pg_stat_activity``) after the commit, and a process counts as
done when it acknowledged the transaction's last announcement, or answered ``'*'`` after that
announcement was delivered (it then expires everything right after, and trusts nothing until it
has). A process that connects after the commit needs no confirmation: it trusts no cached answer
until it has expired its cache. So when :func:`changing_keys` returns with
:attr:`Propagation.complete`, the next request to any gateway process sees the change.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine, event, make_url, text
from sqlmodel import Session

from switchyard.store.db import session_scope

if TYPE_CHECKING:
    import psycopg

T = TypeVar("T")

log = logging.getLogger("switchyard.keys")

#: The PostgreSQL channel a key change is announced on (payload ``<token> <n> <target>``).
CHANNEL = "switchyard_keys"
#: The channel gateway processes confirm on (payload ``<token> <n>``, or ``*`` after a reconnect).
ACK_CHANNEL = "switchyard_keys_ack"
#: The ``application_name`` of every gateway process's LISTEN connection (revokers count them).
LISTENER_NAME = "switchyard-keys"
#: The ``'*'`` acknowledgement: "I expire every cached identity right after this" (sent on connecting).
EVERYTHING = "*"
#: Longest wait for the listening gateway processes' confirmations.
ACK_WAIT_S = 2.0
#: How often, while waiting, the listeners that went away are struck from those waited for.
_RECOUNT_S = 0.1
#: Busy timeout of the SQLite marker's reads (on the event loop: never wait long, look up instead).
MARKER_BUSY_S = 0.02
#: Longest a gateway process goes without reading the SQLite marker itself while the key stamp stays still (a
#: writer that died between its commit and its stamp, or could not write the stamp, is caught up with then).
MARKER_RECHECK_S = 0.25
#: The key stamp's file: the database file's name and this (see the module doc).
STAMP_SUFFIX = "-keys"
STAMP_BYTES = 8
_STAMP_AFTER_COMMIT = "switchyard.key_stamp"

_PENDING = "switchyard.key_changes"
_MARKER_MODULUS = 2**31  # user_version is a signed 32-bit integer


@dataclass
class _Pending:
    """What a transaction announced: its token and the targets, in order."""

    token: str
    targets: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Propagation:
    """How a change reached the gateway processes.

    Attributes:
        targets: What was announced (``key:<id>``, ``tenant:<id>``).
        listeners: The gateway processes (PostgreSQL LISTEN connections) that had to confirm.
        confirmed: How many of them did in time.
        waited_s: How long the confirmations took (or the wait lasted).
    """

    targets: tuple[str, ...] = ()
    listeners: int = 0
    confirmed: int = 0
    waited_s: float = 0.0

    @property
    def complete(self) -> bool:
        """Whether every listening gateway process confirmed."""
        return self.confirmed >= self.listeners

    def describe(self) -> dict[str, Any]:
        """For the admin API's answers."""
        return {"targets": list(self.targets), "listeners": self.listeners, "confirmed": self.confirmed,
                "waited_ms": round(self.waited_s * 1000, 1), "complete": self.complete}


def _pending(session: Session) -> _Pending:
    pending = session.info.get(_PENDING)
    if not isinstance(pending, _Pending):
        pending = _Pending(secrets.token_hex(8))
        session.info[_PENDING] = pending
    return pending


def announce(session: Session, target: str) -> None:
    """Announce, in ``session``'s transaction, that cached identities of ``target`` must go.

    Args:
        session: The session whose transaction carries the change.
        target: ``key:<id>`` or ``tenant:<id>``.
    """
    pending = _pending(session)
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, :payload)"),
                        {"channel": CHANNEL, "payload": f"{pending.token} {len(pending.targets)} {target}"})
    elif dialect == "sqlite":
        # A write first: it takes the database's write lock, so no other writer can bump the marker
        # between this read and this write (it matches no row).
        session.execute(text("UPDATE tenant SET id = id WHERE 1 = 0"))
        current = int(session.execute(text("PRAGMA user_version")).scalar_one())
        session.execute(text(f"PRAGMA user_version = {(current + 1) % _MARKER_MODULUS}"))
        database = session.get_bind().engine.url.database
        if database and database != ":memory:" and _STAMP_AFTER_COMMIT not in session.info:
            session.info[_STAMP_AFTER_COMMIT] = stamp_path(database)
            if not event.contains(session, "after_commit", _stamp_after_commit):
                event.listen(session, "after_commit", _stamp_after_commit)
                event.listen(session, "after_rollback", _forget_stamp)
    pending.targets.append(target)


def stamp_path(database: str) -> str:
    """The key stamp's file for a SQLite database file."""
    return database + STAMP_SUFFIX


def write_stamp(path: str) -> None:
    """Move the key stamp at ``path`` (fresh random bytes: no two writers can leave it where it was)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, secrets.token_bytes(STAMP_BYTES), 0)
    finally:
        os.close(fd)


def _stamp_after_commit(session: Session) -> None:
    path = session.info.pop(_STAMP_AFTER_COMMIT, None)
    if path is None:
        return
    try:
        write_stamp(path)
    except OSError as exc:  # the readers' recheck catches up (MARKER_RECHECK_S)
        log.warning("key stamp %s could not be written (%s); other processes see the change within %.2f s",
                    path, exc, MARKER_RECHECK_S)


def _forget_stamp(session: Session) -> None:
    session.info.pop(_STAMP_AFTER_COMMIT, None)


def parse_notice(payload: str) -> tuple[str, str]:
    """A ``switchyard_keys`` payload's acknowledgement and target.

    Raises:
        ValueError: not a payload :func:`announce` makes.
    """
    token, n, target = payload.split(" ", 2)
    if not token or not n.isdigit() or not target:
        raise ValueError(f"not a key change notice: {payload!r}")
    return f"{token} {n}", target


def libpq_url(sqlalchemy_url: str) -> str | None:
    """The URL psycopg connects with for a SQLAlchemy PostgreSQL URL; None for other databases."""
    url = make_url(sqlalchemy_url)
    if url.get_backend_name() != "postgresql":
        return None
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def changing_keys(engine: Engine, work: Callable[[Session], T], *, wait_s: float = ACK_WAIT_S,
                  committed: Callable[[tuple[str, ...]], None] | None = None) -> tuple[T, Propagation]:
    """Run ``work`` in one transaction; return once every gateway process dropped what it announced.

    Blocking (run it on a worker thread in an event loop). On SQLite there is nothing to wait for:
    each process reads the marker before it answers from its cache.

    Args:
        engine: The database.
        work: The change; it calls :func:`announce` (``revoke_key``, ``delete_tenant``, ... do).
        wait_s: Longest wait for the confirmations; a shortfall is logged as a warning.
        committed: Called with the targets right after the commit (the caller's own cache drops them).

    Returns:
        What ``work`` returned, and how the change propagated.
    """
    url = libpq_url(engine.url.render_as_string(hide_password=False))
    if url is None:
        with session_scope(engine) as session:
            result = work(session)
            targets = tuple(_pending(session).targets) if _PENDING in session.info else ()
        if targets and committed is not None:
            committed(targets)
        return result, Propagation(targets)
    import psycopg  # (PostgreSQL only: SQLite's processes never load it)

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        conn.execute(f"LISTEN {ACK_CHANNEL}")
        with session_scope(engine) as session:
            pending = _pending(session)
            result = work(session)
        targets = tuple(pending.targets)
        if not targets:
            return result, Propagation()
        if committed is not None:
            committed(targets)
        propagation = _confirmations(conn, pending, wait_s)
    if not propagation.complete:
        log.warning("key change %s: %d of %d gateway processes did not confirm within %.1f s; they may answer "
                    "from their key cache until it expires (SWITCHYARD_KEY_CACHE_TTL_S)", " ".join(targets),
                    propagation.listeners - propagation.confirmed, propagation.listeners, wait_s)
    return result, propagation


def _listeners(conn: psycopg.Connection[Any]) -> set[int]:
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = "
                        "current_database()", (LISTENER_NAME,)).fetchall()
    return {int(row[0]) for row in rows}


def _confirmations(conn: psycopg.Connection[Any], pending: _Pending, wait_s: float) -> Propagation:
    """Wait (at most ``wait_s``) for every listener to confirm the transaction's last announcement."""
    started = time.monotonic()
    deadline = started + wait_s
    last = f"{pending.token} {len(pending.targets) - 1}"
    expected = _listeners(conn)
    initially = len(expected)
    confirmed: set[int] = set()
    delivered = False  # whether our own announcement came through (what follows it is newer)
    recounted = started
    while True:
        if delivered and expected <= confirmed:
            break
        now = time.monotonic()
        if now >= deadline:
            break
        if now - recounted >= _RECOUNT_S:  # a listener that went away waits for nothing
            expected &= _listeners(conn) | confirmed
            recounted = now
        for notice in conn.notifies(timeout=min(deadline - now, _RECOUNT_S), stop_after=1):
            if notice.channel == CHANNEL:
                delivered = delivered or notice.payload.startswith(pending.token + " ")
            elif notice.payload == last or (delivered and notice.payload == EVERYTHING):
                confirmed.add(notice.pid)
    gone = initially - len(expected)
    return Propagation(tuple(pending.targets), initially - gone, len(confirmed & expected),
                       time.monotonic() - started)


class SqliteKeyMarker:
    """The SQLite key-change marker (``PRAGMA user_version``), read through a connection of its own when the key
    stamp moved or :data:`MARKER_RECHECK_S` passed (see the module doc).

    Args:
        path: The database file.
        clock: Monotonic seconds (tests move it).
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._conn = sqlite3.connect(path, timeout=MARKER_BUSY_S, isolation_level=None, check_same_thread=False)
        self._clock = clock
        self._stamp: mmap.mmap | None = None
        try:
            fd = os.open(stamp_path(path), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < STAMP_BYTES:
                    os.ftruncate(fd, STAMP_BYTES)
                self._stamp = mmap.mmap(fd, STAMP_BYTES, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except OSError as exc:  # a read-only directory: the marker is read on every call instead
            log.warning("key stamp %s unavailable (%s); reading the key-change marker on every request",
                        stamp_path(path), exc)
        self._seen: bytes | None = None
        self._version = 0
        self._recheck_at = -float("inf")

    def read(self) -> int:
        """The current marker.

        Raises:
            sqlite3.Error: the database is busy or unreadable (look the key up instead).
        """
        stamp = self._stamp[:STAMP_BYTES] if self._stamp is not None else None
        now = self._clock()
        if stamp is None or stamp != self._seen or now >= self._recheck_at:
            row = self._conn.execute("PRAGMA user_version").fetchone()
            self._version = int(row[0])
            self._seen = stamp
            self._recheck_at = now + MARKER_RECHECK_S
        return self._version

    def close(self) -> None:
        if self._stamp is not None:
            self._stamp.close()
        self._conn.close()


def key_marker(database_url: str) -> SqliteKeyMarker | None:
    """The marker reader for a SQLite database file; None for PostgreSQL and in-memory SQLite (one process)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return SqliteKeyMarker(url.database)
