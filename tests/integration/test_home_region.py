"""Home regions of tenants and keys: the store, the migration, the admin API and the CLI, on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from sqlalchemy import Engine, inspect, text

from switchyard.cli.context import cli_origin
from switchyard.store import db
from switchyard.store.audit import list_events
from switchyard.store.errors import NotFound, StoreError
from switchyard.store.keys import create_key, hash_key, identify, list_keys, set_key_region
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant, get_tenant, list_tenants, set_tenant_region
from tests.integration.conftest import ADMIN_AUTH as AUTH
from tests.integration.test_policy_cli import Cli, _env

# --- store -----------------------------------------------------------------------------------

def test_a_key_is_homed_in_its_own_region_else_its_tenants(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        assert create_tenant(s, TenantCreate(name="acme", tier="pro", region="eu-west")).region == "eu-west"
        create_tenant(s, TenantCreate(name="bare", tier="pro"))
        own_secret, own = create_key(s, "acme", "own", region="us-east")
        inherit_secret, inherit = create_key(s, "acme", "inherits")
        bare_secret, bare = create_key(s, "bare")
    assert (own.region, own.home_region) == ("us-east", "us-east")
    assert (inherit.region, inherit.home_region) == (None, "eu-west")
    assert (bare.region, bare.home_region) == (None, None)
    with db.session_scope(engine) as s:
        assert [(t.name, t.region) for t in list_tenants(s)] == [("acme", "eu-west"), ("bare", None)]
        assert [(k.region, k.home_region) for k in list_keys(s)] == [
            ("us-east", "us-east"), (None, "eu-west"), (None, None)]
        regions = {secret: identify(s, hash_key(secret)) for secret in (own_secret, inherit_secret, bare_secret)}
    assert {secret: who.region if who else "?" for secret, who in regions.items()} == {
        own_secret: "us-east", inherit_secret: "eu-west", bare_secret: None}

    # Changing the tenant's region moves the keys that have none of their own, and only those.
    with db.session_scope(engine) as s:
        assert set_tenant_region(s, "acme", "ap-south", actor="ops", origin="test").region == "ap-south"
        assert identify(s, hash_key(inherit_secret)).region == "ap-south"  # type: ignore[union-attr]
        assert identify(s, hash_key(own_secret)).region == "us-east"  # type: ignore[union-attr]
        cleared = set_key_region(s, own.id, None, actor="ops", origin="test")
        assert (cleared.region, cleared.home_region) == (None, "ap-south")
        assert set_tenant_region(s, "acme", None, actor="ops", origin="test").region is None
        assert identify(s, hash_key(own_secret)).region is None  # type: ignore[union-attr]
        homed = set_key_region(s, bare.id, "eu-west", actor="ops", origin="test")
        assert (homed.region, homed.home_region) == ("eu-west", "eu-west")
        events = list_events(s, 10)
    assert [(e.action, e.target, e.actor, e.detail) for e in events[:4]] == [
        ("key.region", f"key:{bare.id}", "ops", {"region": "eu-west", "previous": None}),
        ("tenant.region", "tenant:acme", "ops", {"region": None, "previous": "ap-south"}),
        ("key.region", f"key:{own.id}", "ops", {"region": None, "previous": "us-east"}),
        ("tenant.region", "tenant:acme", "ops", {"region": "ap-south", "previous": "eu-west"}),
    ]


def test_bad_regions_and_unknown_records_write_nothing(engine: Engine) -> None:
    with db.session_scope(engine) as s:
        create_tenant(s, TenantCreate(name="acme", tier="pro", region="eu-west"))
        _, key = create_key(s, "acme")
    for bad in ("EU-West", "", "x" * 64):
        with pytest.raises(StoreError, match="invalid region"), db.session_scope(engine) as s:
            set_tenant_region(s, "acme", bad, actor="t", origin="t")
        with pytest.raises(StoreError, match="invalid region"), db.session_scope(engine) as s:
            set_key_region(s, key.id, bad, actor="t", origin="t")
        with pytest.raises(StoreError, match="invalid region"), db.session_scope(engine) as s:
            create_key(s, "acme", region=bad)
    with pytest.raises(NotFound), db.session_scope(engine) as s:
        set_tenant_region(s, "nobody", "eu-west", actor="t", origin="t")
    with pytest.raises(NotFound), db.session_scope(engine) as s:
        set_key_region(s, 999, "eu-west", actor="t", origin="t")
    with db.session_scope(engine) as s:
        assert get_tenant(s, "acme").region == "eu-west"
        assert [(k.id, k.region) for k in list_keys(s)] == [(key.id, None)]
        assert [e for e in list_events(s) if e.action.endswith(".region")] == []


# --- migration -------------------------------------------------------------------------------

def _columns(engine: Engine, table: str) -> dict[str, Any]:
    return {c["name"]: c for c in inspect(engine).get_columns(table)}


def test_migration_0004_adds_and_removes_the_home_regions(database_url: str) -> None:
    engine = db.create_db_engine(database_url)
    try:
        db.upgrade(engine, "0003")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenant (id, name, tier, created_at) VALUES (1, 'acme', 'free', :t)"),
                         {"t": "2026-12-01 12:00:00+00:00"})
            conn.execute(text("INSERT INTO api_key (id, tenant_id, prefix, key_hash, created_at) "
                              "VALUES (1, 1, 'sk-sy-abc', 'h', :t)"), {"t": "2026-12-01 12:00:00+00:00"})
        db.upgrade(engine, "0004")
        for table in ("tenant", "api_key"):
            column = _columns(engine, table)["region"]
            assert column["nullable"] and column["type"].length == 63
        with db.session_scope(engine) as s:
            assert get_tenant(s, "acme").region is None  # existing rows get no home region
            assert identify(s, "h").region is None  # type: ignore[union-attr]
            set_tenant_region(s, "acme", "eu-west", actor="t", origin="t")
            set_key_region(s, 1, "us-east", actor="t", origin="t")

        db.downgrade(engine, "0003")
        assert "region" not in _columns(engine, "tenant")
        assert "region" not in _columns(engine, "api_key")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM tenant")).scalars().all() == ["acme"]
            assert conn.execute(text("SELECT tenant_id FROM api_key")).scalars().all() == [1]
        db.upgrade(engine)
        assert db.is_current(engine)
        with db.session_scope(engine) as s:
            assert get_tenant(s, "acme").region is None
    finally:
        engine.dispose()


# --- admin API -------------------------------------------------------------------------------

def test_the_admin_api_sets_home_regions_with_the_token_and_audits_them(admin_client: TestClient[Any]) -> None:
    body = {"region": "eu-west", "author": "ops"}
    assert admin_client.put("/admin/api/tenants/acme/region", json=body).status_code == 401
    assert admin_client.put("/admin/api/keys/1/region", json=body).status_code == 401

    done = admin_client.put("/admin/api/tenants/acme/region", json=body, headers=AUTH)
    assert done.status_code == 200 and done.json() == {"region": "eu-west"}
    key = admin_client.put("/admin/api/keys/1/region", json={"region": None}, headers=AUTH)
    assert key.status_code == 200 and key.json() == {"region": None, "home_region": "eu-west"}
    key = admin_client.put("/admin/api/keys/1/region", json={"region": "us-east"}, headers=AUTH)
    assert key.json() == {"region": "us-east", "home_region": "us-east"}

    bad = admin_client.put("/admin/api/tenants/acme/region", json={"region": "EU West"}, headers=AUTH)
    assert bad.status_code == 400 and "invalid region 'EU West'" in bad.json()["error"]["message"]
    assert admin_client.put("/admin/api/keys/1/region", json={"region": 7}, headers=AUTH).status_code == 400
    assert admin_client.put("/admin/api/keys/1/region", json={}, headers=AUTH).status_code == 400
    assert admin_client.put("/admin/api/keys/1/region", json={"region": "a", "x": 1}, headers=AUTH).status_code == 400
    assert admin_client.put("/admin/api/tenants/nobody/region", json=body, headers=AUTH).status_code == 404
    assert admin_client.put("/admin/api/keys/99/region", json=body, headers=AUTH).status_code == 404

    events = admin_client.get("/admin/api/audit", params={"action": "key.region"}, headers=AUTH).json()["events"]
    assert [(e["target"], e["actor"], e["detail"]) for e in events] == [
        ("key:1", "api", {"region": "us-east", "previous": None}), ("key:1", "api", {"region": None, "previous": None})]
    events = admin_client.get("/admin/api/audit", params={"action": "tenant.region"}, headers=AUTH).json()["events"]
    assert [(e["target"], e["actor"], e["detail"]) for e in events] == [
        ("tenant:acme", "ops", {"region": "eu-west", "previous": None})]
    with db.session_scope(admin_client.app.state.runtime.engine) as s:
        assert get_tenant(s, "acme").region == "eu-west"


# --- CLI -------------------------------------------------------------------------------------

@pytest.fixture
def cli(tmp_path: Path, database_url: str) -> Cli:
    run = Cli(_env(tmp_path, database_url, "file"))  # regions us-east and eu-west; tiers free and pro
    run("db", "upgrade")
    return run


def test_the_cli_sets_home_regions_and_warns_about_regions_the_policy_lacks(cli: Cli, tmp_path: Path) -> None:
    bad = cli("tenants", "create", "acme", "--tier", "pro", "--region", "EU", code=2)
    assert "invalid region 'EU'" in bad.stderr and "--region" in bad.stderr
    created = cli("tenants", "create", "acme", "--tier", "pro", "--region", "eu-west")
    assert "created tenant acme (tier pro, region eu-west)" in created.stdout and "warning" not in created.stderr
    mars = cli("tenants", "create", "mars-corp", "--tier", "free", "--region", "mars")
    assert "warning: region 'mars' is not among the regions of the policy" in mars.stderr
    assert "us-east, eu-west" in mars.stderr

    assert "home region eu-west" in cli("keys", "create", "--tenant", "acme", "--name", "inherits").stderr
    own = cli("keys", "create", "--tenant", "acme", "--name", "own", "--region", "us-east")
    assert "home region us-east" in own.stderr and "warning" not in own.stderr
    assert "invalid region 'Nope'" in cli("keys", "create", "--tenant", "acme", "--region", "Nope", code=2).stderr
    listed = cli("keys", "list").stdout
    assert "eu-west (tenant)" in listed and "us-east" in listed
    keys = json.loads(cli("keys", "list", "--json").stdout)
    assert [(k["name"], k["region"], k["home_region"]) for k in keys] == [
        ("inherits", None, "eu-west"), ("own", "us-east", "us-east")]
    inherit_id, own_id = keys[0]["id"], keys[1]["id"]

    assert "tenant acme: region us-east" in cli("tenants", "set-region", "acme", "us-east", "--author", "a").stdout
    unknown = cli("keys", "set-region", str(inherit_id), "moon")
    assert f"key {inherit_id}: region moon" in unknown.stdout and "warning: region 'moon'" in unknown.stderr
    cleared = cli("keys", "set-region", str(own_id), "--clear")
    assert f"key {own_id}: no region (its tenant's region us-east applies)" in cleared.stdout
    assert "tenant mars-corp: no region" in cli("tenants", "set-region", "mars-corp", "--clear").stdout
    assert "give REGION, or --clear" in cli("tenants", "set-region", "acme", "eu-west", "--clear", code=2).stderr
    assert "give REGION, or --clear" in cli("keys", "set-region", str(own_id), code=2).stderr
    assert "invalid region 'Bad!'" in cli("tenants", "set-region", "acme", "Bad!", code=2).stderr
    assert "no tenant named 'nobody'" in cli("tenants", "set-region", "nobody", "eu-west", code=1).stderr
    assert "no key with id 999" in cli("keys", "set-region", "999", "eu-west", code=1).stderr

    tenants = json.loads(cli("tenants", "list", "--json").stdout)
    assert [(t["name"], t["region"]) for t in tenants] == [("acme", "us-east"), ("mars-corp", None)]
    assert "us-east" in cli("tenants", "list").stdout
    keys = json.loads(cli("keys", "list", "--json").stdout)
    assert [(k["name"], k["region"], k["home_region"]) for k in keys] == [
        ("inherits", "moon", "moon"), ("own", None, "us-east")]
    events = [e for e in json.loads(cli("policy", "audit", "--json").stdout) if e["action"].endswith(".region")]
    assert [(e["action"], e["target"], e["detail"]["region"]) for e in events] == [
        ("tenant.region", "tenant:mars-corp", None), ("key.region", f"key:{own_id}", None),
        ("key.region", f"key:{inherit_id}", "moon"), ("tenant.region", "tenant:acme", "us-east")]
    assert events[-1]["actor"] == "a" and events[0]["actor"].startswith("cli:") and events[0]["origin"] == cli_origin()

    # A policy that cannot be read only costs the check, never the change.
    cli.env["SWITCHYARD_POLICY_FILE"] = str(tmp_path / "missing.yaml")
    blind = cli("tenants", "set-region", "acme", "eu-west")
    assert "tenant acme: region eu-west" in blind.stdout
    assert "warning: cannot check region 'eu-west' against the policy" in blind.stderr
