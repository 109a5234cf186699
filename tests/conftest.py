"""Shared fixtures: free ports, fresh databases on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

# The PostgreSQL server these machines run (trust auth). A test that needs it fails, loudly,
# when it does not answer: CI must never pass by skipping the real database.
PG_ADMIN_DSN = os.environ.get("SWITCHYARD_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{dbname}"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty PostgreSQL databases, dropped at the end of the session."""
    created: list[str] = []
    try:
        admin = psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL at {PG_ADMIN_DSN} does not answer ({exc}); start it (see .ci/run)")

    def make() -> str:
        name = f"switchyard_test_{uuid.uuid4().hex[:12]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _pg_url(name)

    yield make
    for name in created:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path,
                 pg_database: Callable[[], str]) -> str:
    """A fresh empty database, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'switchyard.db'}"
    return pg_database()
