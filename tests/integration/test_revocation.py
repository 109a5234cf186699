"""A revoked key, a deleted tenant's keys and a tier change take effect at the very next request on every
gateway process: two replicas on one PostgreSQL database (no Redis) and two processes on one SQLite file,
changed through one replica's console and through the CLI. The key cache's TTL is a minute here, so
only the change's announcement (``store/key_changes.py``) can make the next request see it: no sleep,
no retry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import Engine

from switchyard.store import db
from switchyard.store.key_changes import ACK_CHANNEL, CHANNEL, LISTENER_NAME, changing_keys, libpq_url
from switchyard.store.keys import create_key, revoke_key
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant
from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop

#: Long enough that no test here can pass by the cache expiring.
TTL_ENV = {"SWITCHYARD_KEY_CACHE_TTL_S": "60", "SWITCHYARD_BATCH_WORKER": "false"}


def status(gw: Gateway, key: str) -> int:
    """The status of ``GET /v1/models`` with ``key`` (no engine involved: only the key is checked)."""
    return http_json("GET", f"{gw.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})[0]


def models(gw: Gateway, key: str) -> set[str]:
    code, _, body = http_json("GET", f"{gw.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert code == 200, body
    return {m["id"] for m in body["data"]}


def key_id(gw: Gateway, tenant: str, secret: str) -> int:
    rows = json.loads(gw.cli("keys", "list", "--tenant", tenant, "--json").stdout)
    (row,) = [r for r in rows if secret.startswith(r["prefix"])]
    return int(row["id"])


def warm(key: str, *gateways: Gateway) -> None:
    """Cache ``key`` on every gateway (twice: the second answer comes from the cache)."""
    for gw in gateways:
        assert status(gw, key) == 200 and status(gw, key) == 200


@pytest.fixture
def replicas(engines: Engines, tmp_path: Path, pg_database: Callable[[], str]) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateway processes on one PostgreSQL database, no Redis, a key cache TTL of a minute."""
    url = pg_database()
    a = start_gateway(engines, url, tmp_path / "a", "postgresql", TTL_ENV)
    try:
        b = start_gateway(engines, url, tmp_path / "b", "postgresql", TTL_ENV)
    except BaseException:
        stop(a.proc)
        raise
    try:
        yield a, b
    finally:
        assert stop(a.proc) and stop(b.proc)


def console_post(gw: Gateway, path: str, data: dict[str, str] | None = None) -> tuple[httpx.Response, float]:
    """A console write as an admin (logged in first); its answer and how long it took."""
    console = gw.console("admin")
    try:
        started = time.monotonic()
        answer = console.post(path, data=data or {}, follow_redirects=False)
        return answer, time.monotonic() - started
    finally:
        console.close()


@pytest.mark.postgres
def test_a_key_revoked_through_one_replicas_console_is_refused_by_the_other_at_once(
        replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    key = a.new_key("rev-console", "pro")
    other = a.new_key("rev-console", "pro")  # the tenant's other key keeps working
    warm(key, a, b)
    warm(other, a, b)
    answer, took = console_post(a, f"/admin/keys/{key_id(a, 'rev-console', key)}/revoke")
    assert answer.status_code == 303, answer.text
    assert status(b, key) == 401 and status(a, key) == 401
    assert status(b, other) == 200 and status(a, other) == 200
    print(f"revocation through the console, both replicas confirmed: {1000 * took:.0f} ms")
    assert took < 2.0, "the revocation waited out its bound: a replica did not confirm"


@pytest.mark.postgres
def test_a_tenant_deleted_through_one_replicas_console_is_refused_by_the_other_at_once(
        replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    keys = [a.new_key("doomed", "free"), a.new_key("doomed", "free")]
    survivor = a.new_key("survivor", "free")
    for key in (*keys, survivor):
        warm(key, a, b)
    refused, _ = console_post(a, "/admin/tenants/doomed/delete", {"confirm": "wrong"})
    assert refused.status_code == 400 and status(b, keys[0]) == 200  # an unconfirmed deletion deletes nothing
    answer, took = console_post(a, "/admin/tenants/doomed/delete", {"confirm": "doomed"})
    assert answer.status_code == 303, answer.text
    print(f"deletion through the console, both replicas confirmed: {1000 * took:.0f} ms")
    assert [status(b, k) for k in keys] == [401, 401] and [status(a, k) for k in keys] == [401, 401]
    assert status(b, survivor) == 200
    assert "doomed" not in a.cli("tenants", "list").stdout
    _, _, audit = http_json("GET", f"{a.base_url}/admin/api/audit?action=tenant.delete")
    (event,) = audit["events"]
    assert event["target"] == "tenant:doomed" and event["detail"]["keys"] == 2


@pytest.mark.postgres
def test_the_cli_revokes_deletes_and_moves_at_the_next_request_of_every_replica(
        replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    key = a.new_key("rev-cli", "pro")
    warm(key, a, b)
    revoked = a.cli("keys", "revoke", str(key_id(a, "rev-cli", key)))
    assert status(b, key) == 401 and status(a, key) == 401
    assert "2 gateway process(es) dropped it from their key cache" in revoked.stderr, revoked.stderr

    moving = a.new_key("mover", "free")
    warm(moving, a, b)
    assert "large" not in models(b, moving)
    a.cli("tenants", "set-tier", "mover", "pro")
    assert "large" in models(b, moving) and "large" in models(a, moving)

    gone = a.new_key("gone", "free")
    warm(gone, a, b)
    deleted = a.cli("tenants", "delete", "gone", "--yes")
    assert "deleted tenant gone: 1 key(s)" in deleted.stdout
    assert status(b, gone) == 401 and status(a, gone) == 401
    print(f"cli: {revoked.stderr.strip()} / {deleted.stderr.strip()}")


@pytest.mark.postgres
def test_a_replica_whose_listener_dropped_trusts_no_cached_key(
        replicas: tuple[Gateway, Gateway], pg_database: Callable[[], str]) -> None:
    """B's LISTEN connection is cut just before the revocation: whether or not it is back yet, B must not
    answer from its cache (it looks keys up until it listens again, and expires its cache when it does)."""
    a, b = replicas
    key = a.new_key("cut", "pro")
    warm(key, a, b)
    url = libpq_url(a.env["SWITCHYARD_DATABASE_URL"])
    assert url is not None
    with psycopg.connect(url, autocommit=True) as conn:
        pids = [row[0] for row in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
            (LISTENER_NAME,)).fetchall()]
        assert len(pids) == 2
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
                     "AND datname = current_database()", (LISTENER_NAME,))
    a.cli("keys", "revoke", str(key_id(a, "cut", key)))
    assert status(b, key) == 401 and status(a, key) == 401


@pytest.mark.postgres
def test_a_revoker_waits_for_a_silent_listener_at_most_its_bound_and_says_so(
        engine_pg: tuple[str, Engine], caplog: pytest.LogCaptureFixture) -> None:
    """A listener that never confirms (a process stuck, not gone) costs the bounded wait and a warning,
    not a hang; one that confirms with ``*`` before the change does not count."""
    url, engine = engine_pg
    libpq = libpq_url(url)
    assert libpq is not None
    with psycopg.connect(libpq, autocommit=True, application_name=LISTENER_NAME) as silent:
        silent.execute(f"LISTEN {CHANNEL}")
        silent.execute("SELECT pg_notify(%s, '*')", (ACK_CHANNEL,))  # before the change: says nothing of it
        with caplog.at_level("WARNING", logger="switchyard.keys"):
            started = time.monotonic()
            record, propagation = changing_keys(engine, lambda s: revoke_key(s, 1), wait_s=0.5)
            waited = time.monotonic() - started
        assert record.revoked_at is not None
        assert (propagation.listeners, propagation.confirmed, propagation.complete) == (1, 0, False)
        assert 0.5 <= waited < 2.0
        assert "1 of 1 gateway processes did not confirm" in caplog.text
        notices = list(silent.notifies(timeout=0.5, stop_after=1))
        assert notices and notices[0].payload.endswith(" 0 key:1")


@pytest.fixture
def engine_pg(pg_database: Callable[[], str]) -> Iterator[tuple[str, Engine]]:
    """A migrated PostgreSQL database with tenant ``t`` and its key 1."""
    url = pg_database()
    engine = db.create_db_engine(url)
    db.upgrade(engine)
    with db.session_scope(engine) as session:
        create_tenant(session, TenantCreate(name="t", tier="free"))
        create_key(session, "t")
    yield url, engine
    engine.dispose()


def test_processes_on_one_sqlite_file_refuse_a_revoked_key_at_their_next_request(
        engines: Engines, tmp_path: Path) -> None:
    """Two gateway processes on one SQLite file (what ``serve --workers 2`` makes, without Redis here):
    a revocation through one's console, a CLI revocation and a CLI deletion reach both at once."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a = start_gateway(engines, url, tmp_path / "a", "sqlite", TTL_ENV)
    try:
        b = start_gateway(engines, url, tmp_path / "b", "sqlite", TTL_ENV)
    except BaseException:
        stop(a.proc)
        raise
    try:
        by_console, by_cli, deleted = a.new_key("lite", "pro"), a.new_key("lite", "pro"), a.new_key("lite-gone", "pro")
        for key in (by_console, by_cli, deleted):
            warm(key, a, b)
        answer, _ = console_post(a, f"/admin/keys/{key_id(a, 'lite', by_console)}/revoke")
        assert answer.status_code == 303
        assert status(a, by_console) == 401 and status(b, by_console) == 401
        assert status(a, by_cli) == 200 and status(b, by_cli) == 200  # cached again: the marker moved
        a.cli("keys", "revoke", str(key_id(a, "lite", by_cli)))
        assert status(b, by_cli) == 401 and status(a, by_cli) == 401
        a.cli("tenants", "delete", "lite-gone", "--yes")
        assert status(a, deleted) == 401 and status(b, deleted) == 401
    finally:
        assert stop(a.proc) and stop(b.proc)
