"""Publishing, rolling back and auditing policy versions, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from switchyard.policy import PolicyError, policy_sha256
from switchyard.store import db
from switchyard.store.audit import append_event, list_events
from switchyard.store.errors import NotFound, StoreError
from switchyard.store.policy_versions import (
    CHANNEL,
    active_version,
    get_version,
    list_versions,
    publish,
    record_version,
    rollback,
)
from tests.unit.policy.base import base, free_tokens_per_day, to_yaml

V1 = to_yaml(base())


V2 = free_tokens_per_day(5000)  # v1 says 10000


def _counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT count(*) FROM policy_version")).scalar_one()
        events = conn.execute(text("SELECT count(*) FROM audit_event")).scalar_one()
    return versions, events


def test_publish_chains_versions_and_audits_each(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        v1, new1 = publish(s, V1, source="api", author="alice", message="first", origin="api 10.0.0.7")
    with db.session_scope(engine) as s:
        again, new_again = publish(s, V1, source="cli", author="bob")
        v2, new2 = publish(s, V2, source="console", author="carol", message="tighter free tier")
    assert (v1.number, new1, v1.parent, again.number, new_again) == (1, True, None, 1, False)
    assert (v2.number, new2, v2.parent, v2.source, v2.author) == (2, True, 1, "console", "carol")
    with db.session_scope(engine) as s:
        stored = get_version(s, 2)
        assert (stored.yaml_text, stored.sha256, stored.active) == (V2, policy_sha256(V2), True)
        assert [v.number for v in list_versions(s)] == [2, 1]
        events = list_events(s)
    assert [(e.action, e.target, e.actor, e.origin) for e in events] == [
        ("policy.publish", "policy:v2", "carol", "console"),
        ("policy.publish", "policy:v1", "alice", "api 10.0.0.7"),
    ]
    assert events[0].detail == {"from": 1, "to": 2, "sha256": policy_sha256(V2), "source": "console",
                                "message": "tighter free tier"}


def test_an_invalid_document_writes_nothing(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        publish(s, V1, source="api", author="alice")
    bad = base()
    bad["tiers"][0]["priority"] = "nope"
    failing = base()
    failing["tests"][0]["expect"]["model"] = "large"
    for document in (to_yaml(bad), to_yaml(failing), "schema: [1"):
        with pytest.raises(PolicyError) as raised, db.session_scope(engine) as s:
            publish(s, document, source="api", author="alice", document="candidate.yaml")
        assert all(i.source == "candidate.yaml" for i in raised.value.issues)
    with pytest.raises(StoreError, match="author"), db.session_scope(engine) as s:
        publish(s, V2, source="api", author="x" * 129)
    assert _counts(engine) == (1, 1)
    with db.session_scope(engine) as s:
        active = active_version(s)
        assert active is not None and active.number == 1


def test_rollback_is_a_new_version_with_the_old_content(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        publish(s, V1, source="api", author="alice")
        publish(s, V2, source="api", author="alice")
    with db.session_scope(engine) as s:
        v3, created = rollback(s, 1, author="bob", origin="cli host-a")
    assert (v3.number, created, v3.parent, v3.source, v3.message) == (3, True, 2, "rollback", "rollback to v1")
    with db.session_scope(engine) as s:
        assert get_version(s, 3).yaml_text == V1
        same, created_again = rollback(s, 1, author="bob")  # v1's content is what is active now
        assert (same.number, created_again) == (3, False)
        (event, *_) = list_events(s)
        with pytest.raises(NotFound, match="no policy version 9"):
            rollback(s, 9, author="bob")
    assert (event.action, event.target, event.actor, event.origin) == ("policy.rollback", "policy:v3", "bob",
                                                                       "cli host-a")
    assert event.detail["rollback_to"] == 1 and event.detail["from"] == 2
    assert _counts(engine) == (3, 3)


def test_file_imports_are_audited_too(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        record_version(s, text=V1, sha256=policy_sha256(V1), source="file", author="file:/etc/policies.yaml")
        (event,) = list_events(s)
    assert (event.action, event.actor, event.origin, event.target) == ("policy.import", "file:/etc/policies.yaml",
                                                                       "file", "policy:v1")


def test_the_database_refuses_to_change_the_audit_log(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        append_event(s, actor="alice", origin="cli", action="policy.publish", target="policy:v1", detail={"a": 1})
    for statement in ("UPDATE audit_event SET actor = 'mallory'", "DELETE FROM audit_event"):
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement))
    with db.session_scope(engine) as s:
        assert [(e.actor, e.detail) for e in list_events(s)] == [("alice", {"a": 1})]


def test_the_audit_migration_goes_both_ways(engine: Engine) -> None:
    db.downgrade(engine, "0001")
    assert "audit_event" not in inspect(engine).get_table_names()
    db.upgrade(engine)  # the trigger (and on PostgreSQL its function) are made anew
    with db.session_scope(engine) as s:
        append_event(s, actor="a", origin="cli", action="policy.publish", target="policy:v1")
    with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
        conn.execute(text("DELETE FROM audit_event"))


@pytest.mark.postgres
def test_postgresql_refuses_truncate_of_the_audit_log(pg_database: Callable[[], str]) -> None:
    engine = db.create_db_engine(pg_database())
    try:
        db.upgrade(engine)
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text("TRUNCATE audit_event"))
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_new_version_is_announced_on_postgresql_when_it_commits(pg_database: Callable[[], str]) -> None:
    url = pg_database()
    engine = db.create_db_engine(url)
    listener = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    try:
        db.upgrade(engine)
        listener.execute(f"LISTEN {CHANNEL}")
        # A publish that rolls back announces nothing.
        with pytest.raises(RuntimeError), db.session_scope(engine) as s:
            publish(s, V1, source="api", author="alice")
            raise RuntimeError("the caller fails after publishing")
        assert list(listener.notifies(timeout=0.5)) == []
        with db.session_scope(engine) as s:
            publish(s, V1, source="api", author="alice")
            publish(s, V1, source="api", author="alice")  # no new version: no announcement
        with db.session_scope(engine) as s:
            rollback(s, 1, author="bob")  # already active: no announcement either
            publish(s, V2, source="api", author="alice")
        received = [(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=2)]
        assert received == [(CHANNEL, "1"), (CHANNEL, "2")]
    finally:
        listener.close()
        engine.dispose()
