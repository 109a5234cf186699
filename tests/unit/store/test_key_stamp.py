"""The SQLite key-change marker as a gateway process reads it: the key stamp beside the database moves right
after a change commits, and the marker itself is read only when it did (or after the recheck interval)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlmodel import Session

from switchyard.store import db
from switchyard.store.key_changes import MARKER_RECHECK_S, SqliteKeyMarker, changing_keys, stamp_path
from switchyard.store.keys import create_key, revoke_key
from switchyard.store.tenants import TenantCreate, create_tenant


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def database(tmp_path: Path) -> str:
    """A database with tenant ``t`` and two keys (ids 1 and 2); nothing announced yet."""
    path = str(tmp_path / "keys.db")
    engine = db.create_db_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    with db.session_scope(engine) as session:
        create_tenant(session, TenantCreate(name="t", tier="free"))
        create_key(session, "t")
        create_key(session, "t")
    engine.dispose()
    return path


def _user_version(path: str) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def test_a_committed_change_moves_the_stamp_and_the_next_read_sees_it(database: str) -> None:
    clock = Clock()
    marker = SqliteKeyMarker(database, clock)
    engine = db.create_db_engine(f"sqlite:///{database}")
    try:
        before = marker.read()
        stamp = Path(stamp_path(database)).read_bytes()
        changing_keys(engine, lambda session: revoke_key(session, 1))
        assert Path(stamp_path(database)).read_bytes() != stamp
        assert marker.read() == _user_version(database) == before + 1  # the clock stood still: the stamp told it
        changing_keys(engine, lambda session: revoke_key(session, 2))
        assert marker.read() == before + 2
    finally:
        marker.close()
        engine.dispose()


def test_a_rolled_back_change_leaves_the_stamp_alone(database: str) -> None:
    engine = db.create_db_engine(f"sqlite:///{database}")
    stamp = Path(stamp_path(database))
    try:
        changing_keys(engine, lambda session: revoke_key(session, 1))
        written = stamp.read_bytes()

        def fails(session: Session) -> None:
            revoke_key(session, 2)
            raise RuntimeError("changed my mind")

        with pytest.raises(RuntimeError):
            changing_keys(engine, fails)
        assert stamp.read_bytes() == written
        assert _user_version(database) == 1
    finally:
        engine.dispose()


def test_a_marker_moved_without_the_stamp_is_seen_at_the_recheck(database: str) -> None:
    """A writer that died between its commit and its stamp: the marker is read again within the recheck."""
    clock = Clock()
    marker = SqliteKeyMarker(database, clock)
    try:
        first = marker.read()
        with sqlite3.connect(database) as conn:
            conn.execute(f"PRAGMA user_version = {first + 5}")
        assert marker.read() == first  # the stamp did not move: no read of the database
        clock.now += MARKER_RECHECK_S
        assert marker.read() == first + 5
    finally:
        marker.close()


def test_without_a_writable_directory_the_marker_is_read_every_time(tmp_path: Path, database: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import switchyard.store.key_changes as key_changes

    def refuse(*_args: object, **_kwargs: object) -> int:
        raise PermissionError("read-only")

    monkeypatch.setattr(key_changes.os, "open", refuse)
    marker = SqliteKeyMarker(database, Clock())
    monkeypatch.undo()
    try:
        first = marker.read()
        with sqlite3.connect(database) as conn:
            conn.execute(f"PRAGMA user_version = {first + 1}")
        assert marker.read() == first + 1
    finally:
        marker.close()
