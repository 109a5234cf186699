"""The database engine and Alembic upgrades, for SQLite (embedded) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, exc, make_url, text
from sqlmodel import Session

from switchyard.resources import migrations_dir
from switchyard.store.errors import StoreError

T = TypeVar("T")


def create_db_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and enforced foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 10})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=10000")
            cur.close()

        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        # Plain postgresql:// means psycopg 3 here (the only PostgreSQL driver we install).
        parsed = parsed.set(drivername="postgresql+psycopg")
    # A database that stops answering must fail key lookups fast (the gateway then follows the policy's
    # resilience.dependencies.database), not hang them.
    connect_args = {"connect_timeout": 3} if parsed.get_backend_name() == "postgresql" else {}
    return create_engine(parsed, pool_pre_ping=True, pool_size=5, max_overflow=5, pool_timeout=5,
                         connect_args=connect_args)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error: nothing half-written."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


async def in_transaction(engine: Engine, work: Callable[[Session], T]) -> T:
    """Run ``work`` in one :func:`session_scope` on a worker thread (database calls block the event loop).

    Raises:
        StoreError: a value does not fit the database (text with a NUL or longer than its column, a number
            out of its column's range: PostgreSQL refuses them); nothing was written.
    """
    def run() -> T:
        try:
            with session_scope(engine) as session:
                return work(session)
        except exc.DataError as error:
            first_line = (str(error.orig).strip().splitlines() or ["?"])[0]  # (not the statement's text)
            raise StoreError(f"a value does not fit the database: {first_line}") from None

    return await anyio.to_thread.run_sync(run)


def _alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision``."""
    command.upgrade(_alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` for an empty database)."""
    command.downgrade(_alembic_config(engine), revision)


def head_revision() -> str | None:
    """The newest migration shipped with this package."""
    return ScriptDirectory.from_config(_alembic_config(create_engine("sqlite://"))).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at (``None`` for an empty database)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def is_current(engine: Engine) -> bool:
    """Whether the database schema is at this package's head."""
    return current_revision(engine) == head_revision()


def ping(engine: Engine) -> None:
    """Raise if the database cannot answer a trivial query."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
