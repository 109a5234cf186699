"""The database engine and Alembic upgrades, for SQLite (embedded) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.to_thread
from sqlalchemy import Engine, create_engine, event, exc, inspect, make_url, text
from sqlmodel import Session

from switchyard.resources import migrations_dir
from switchyard.store.errors import StoreError

if TYPE_CHECKING:
    from alembic.config import Config

T = TypeVar("T")

#: The newest migration shipped with this package (``migrations/versions``; a unit test holds it to Alembic's
#: script directory). Whether a database is current is read against it, so that the check every command and
#: every gateway start makes imports no Alembic: Alembic brings Mako and Pygments with it, about a tenth of the
#: CPU a ``switchyard keys create`` spends. Alembic itself is imported only to upgrade, downgrade or read its
#: script directory.
SCHEMA_HEAD = "0010"
#: The table Alembic keeps a database's revision in.
VERSION_TABLE = "alembic_version"


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
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision``."""
    from alembic import command

    command.upgrade(_alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` for an empty database)."""
    from alembic import command

    command.downgrade(_alembic_config(engine), revision)


def head_revision() -> str | None:
    """The newest migration shipped with this package, as Alembic's script directory has it (the same as
    :data:`SCHEMA_HEAD`, which needs no Alembic)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config(create_engine("sqlite://"))).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at (``None`` for an empty database), read from Alembic's version table.

    A table naming several revisions (Alembic's branches; this package's migrations have none) gives them all,
    comma-separated: no single revision, so never current.
    """
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        versions = sorted(conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())  # noqa: S608
    return ", ".join(versions) or None


def is_current(engine: Engine) -> bool:
    """Whether the database schema is at this package's head (:data:`SCHEMA_HEAD`)."""
    return current_revision(engine) == SCHEMA_HEAD


def ping(engine: Engine) -> None:
    """Raise if the database cannot answer a trivial query."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
