"""``switchyard db``, and how every other command reaches the database: a checked engine, one session per
command, key changes that wait for the gateways' key caches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import click

from switchyard.cli.context import cli_context
from switchyard.store.errors import StoreError

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlmodel import Session

    from switchyard.settings import Settings
    from switchyard.store.key_changes import Propagation

T = TypeVar("T")


def checked_engine(settings: Settings) -> Engine:
    """An engine on the settings' database, once it answers and its schema is current.

    Raises:
        click.ClickException: The database does not answer, or needs ``switchyard db upgrade``.
    """
    from sqlalchemy.exc import OperationalError

    from switchyard.store import db as store_db

    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        current = store_db.is_current(engine)
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    if not current:
        raise click.ClickException("the database schema is not current; run `switchyard db upgrade` first")
    return engine


@contextmanager
def open_session() -> Iterator[Session]:
    """One transaction on the command's database; a store error becomes the command's error message."""
    from switchyard.store import db as store_db

    engine = checked_engine(cli_context().settings())
    try:
        with store_db.session_scope(engine) as session:
            yield session
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.dispose()


def change_keys(work: Callable[[Session], T]) -> T:
    """Run ``work`` (it revokes a key, deletes a tenant, moves one) in one transaction and wait until every
    running gateway process dropped what it changed from its key cache; says so on stderr."""
    from switchyard.store.key_changes import changing_keys

    engine = checked_engine(cli_context().settings())
    try:
        result, propagation = changing_keys(engine, work)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.dispose()
    _propagated(propagation, engine.dialect.name)
    return result


def _propagated(propagation: Propagation, dialect: str) -> None:
    from switchyard.store.key_changes import ACK_WAIT_S

    if not propagation.targets:
        return
    if dialect != "postgresql":
        click.echo("gateway processes on this database see the change at their next request", err=True)
    elif propagation.listeners == 0:
        click.echo("no gateway process listens on this database now (those that start see the change)", err=True)
    elif propagation.complete:
        click.echo(f"{propagation.listeners} gateway process(es) dropped it from their key cache "
                   f"({propagation.waited_s * 1000:.0f} ms)", err=True)
    else:
        click.echo(f"warning: {propagation.listeners - propagation.confirmed} of {propagation.listeners} gateway "
                   f"processes did not confirm within {ACK_WAIT_S:.0f} s; they may answer from their key cache until "
                   "it expires (SWITCHYARD_KEY_CACHE_TTL_S)", err=True)


@click.group()
def db() -> None:
    """The database schema (Alembic migrations; SQLite or PostgreSQL)."""


@db.command()
def upgrade() -> None:
    """Apply every migration up to the newest."""
    from sqlalchemy.exc import OperationalError

    from switchyard.store import db as store_db

    settings = cli_context().settings()
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        store_db.upgrade(engine)
        click.echo(f"database at revision {store_db.current_revision(engine)} ({engine.url.render_as_string()})")
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()


@db.command()
def current() -> None:
    """Print the database's revision and whether it is the newest."""
    from sqlalchemy.exc import OperationalError

    from switchyard.store import db as store_db

    settings = cli_context().settings()
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        rev, head = store_db.current_revision(engine), store_db.SCHEMA_HEAD
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()
    click.echo(f"{rev or 'empty'} ({'current' if rev == head else f'behind head {head}'})")
