"""Migrations and store services on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel

from switchyard.store import db
from switchyard.store.errors import Conflict, NotFound
from switchyard.store.keys import KEY_PREFIX, create_key, hash_key, identify, list_keys, revoke_key
from switchyard.store.models import PolicyVersion, TenantCreate
from switchyard.store.policy_versions import active_version, list_versions, record_version
from switchyard.store.tenants import create_tenant, list_tenants, set_tier


def test_migrations_match_the_models_and_go_both_ways(database_url: str) -> None:
    engine = db.create_db_engine(database_url)
    try:
        assert db.current_revision(engine) is None and not db.is_current(engine)
        db.upgrade(engine)
        assert db.is_current(engine)
        # The version table read directly (no Alembic) says what Alembic says; one revision behind is not current.
        with engine.connect() as conn:
            assert db.current_revision(engine) == MigrationContext.configure(conn).get_current_revision() \
                == db.SCHEMA_HEAD
        db.downgrade(engine, "-1")
        assert db.current_revision(engine) not in (None, db.SCHEMA_HEAD) and not db.is_current(engine)
        db.upgrade(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                    SQLModel.metadata)
        assert diff == [], f"models and migrations differ: {diff}"
        assert {"tenant", "api_key", "policy_version"} <= set(inspect(engine).get_table_names())
        db.downgrade(engine, "base")
        assert not ({"tenant", "api_key", "policy_version"} & set(inspect(engine).get_table_names()))
        db.upgrade(engine)
        assert db.is_current(engine)
    finally:
        engine.dispose()


def test_keys_are_stored_hashed_shown_once_and_revocable(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        create_tenant(s, TenantCreate(name="acme", tier="pro"))
        secret, record = create_key(s, "acme", "ci")
    assert secret.startswith(KEY_PREFIX) and len(secret) > 40
    assert record.prefix == secret[:12]
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT key_hash, prefix FROM api_key")).one()
    assert stored.key_hash == hash_key(secret) and secret not in stored
    with db.session_scope(engine) as s:
        who = identify(s, hash_key(secret))
        assert who is not None and (who.tenant, who.tier) == ("acme", "pro")
        assert identify(s, hash_key(secret + "x")) is None
        assert [k.id for k in list_keys(s, "acme")] == [record.id]
        revoke_key(s, record.id)
    with db.session_scope(engine) as s:
        assert identify(s, hash_key(secret)) is None
        with pytest.raises(Conflict, match="already revoked"):
            revoke_key(s, record.id)
        with pytest.raises(NotFound):
            revoke_key(s, 999)


def test_tenants(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        create_tenant(s, TenantCreate(name="acme", tier="free"))
    with pytest.raises(Conflict, match="already exists"), db.session_scope(engine) as s:
        create_tenant(s, TenantCreate(name="acme", tier="pro"))
    with db.session_scope(engine) as s:
        set_tier(s, "acme", "pro")
        assert [(t.name, t.tier) for t in list_tenants(s)] == [("acme", "pro")]
        with pytest.raises(NotFound):
            set_tier(s, "nobody", "pro")


def test_a_failed_transaction_writes_nothing(engine: Engine) -> None:
    with pytest.raises(NotFound), db.session_scope(engine) as s:
        create_tenant(s, TenantCreate(name="half", tier="pro"))
        create_key(s, "missing-tenant")
    with db.session_scope(engine) as s:
        assert list_tenants(s) == []


def test_policy_versions_dedupe_chain_and_keep_one_active(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        v1, new1 = record_version(s, text="a", sha256="sha-a", source="file", author="t")
        again, new_again = record_version(s, text="a", sha256="sha-a", source="file", author="t")
        v2, new2 = record_version(s, text="b", sha256="sha-b", source="file", author="t", message="m")
    assert (v1.number, new1, again.number, new_again, v2.number, new2) == (1, True, 1, False, 2, True)
    assert v2.parent == 1
    with db.session_scope(engine) as s:
        active = active_version(s)
        assert active is not None and active.number == 2
        assert [v.number for v in list_versions(s)] == [2, 1]
    # The database itself refuses a second active row.
    with pytest.raises(IntegrityError), db.session_scope(engine) as s:
        s.add(PolicyVersion(number=3, yaml_text="c", sha256="sha-c", source="api", author="t", active=True))
        s.flush()


def test_concurrent_recorders_agree(engine: Engine) -> None:
    results: list[int] = []
    errors: list[BaseException] = []

    def record(i: int) -> None:
        try:
            with db.session_scope(engine) as s:
                version, _ = record_version(s, text=f"t{i}", sha256=f"sha{i}", source="file", author="t")
                results.append(version.number)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=record, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [1, 2, 3, 4]
    with db.session_scope(engine) as s:
        assert len([v for v in list_versions(s) if v.active]) == 1
