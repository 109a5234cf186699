"""Alembic environment: runs on SQLite and PostgreSQL with the tables of switchyard.store.models.

`switchyard db upgrade` passes its engine in ``config.attributes["engine"]``; the alembic CLI
(`alembic -c alembic.ini ...`, for writing new migrations) uses SWITCHYARD_DATABASE_URL.
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlalchemy import Engine, text
from sqlmodel import SQLModel
from sqlmodel.sql.sqltypes import AutoString

import switchyard.store.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from switchyard.settings import Settings
from switchyard.store.db import create_db_engine
from switchyard.store.models import UTCDateTime

config = context.config
target_metadata = SQLModel.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Render project column types as plain SQLAlchemy ones, so migrations never import the app."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    if type_ == "type" and isinstance(obj, AutoString):
        return f"sa.String(length={obj.length})" if obj.length else "sa.String()"
    return False


def _engine() -> Engine:
    engine = config.attributes.get("engine")
    if engine is not None:
        return engine  # type: ignore[no-any-return]
    return create_db_engine(Settings().resolved_database_url)


def run_migrations_offline() -> None:
    context.configure(
        url=str(_engine().url),
        target_metadata=target_metadata,
        literal_binds=True,
        compare_type=True,
        render_as_batch=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = _engine()
    with engine.connect() as connection:
        is_pg = connection.dialect.name == "postgresql"
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            compare_type=True,
            render_as_batch=connection.dialect.name == "sqlite",
            transaction_per_migration=False,
            render_item=_render_item,
        )
        with context.begin_transaction():
            if is_pg:
                # Replicas starting together must not migrate the same database twice.
                connection.execute(text("SELECT pg_advisory_xact_lock(7263514091)"))
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
