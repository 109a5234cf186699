"""The admin API for limit overrides, the usage ledger and the audit log (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from switchyard.gateway.app import create_app
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.keys import create_key
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant
from tests.unit.policy.base import base, to_yaml

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    policy = tmp_path / "policies.yaml"
    policy.write_text(to_yaml(base()))
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy, admin_token=TOKEN)
    with TestClient(app=create_app(settings)) as c:
        with db.session_scope(c.app.state.runtime.engine) as session:
            create_tenant(session, TenantCreate(name="acme", tier="free"))
            create_key(session, "acme")
        yield c


def test_overrides_need_the_token_are_validated_and_audited(client: TestClient[Any]) -> None:
    body = {"limits": {"tokens_per_minute": 5000, "tokens_per_day": None}, "author": "ops"}
    assert client.put("/admin/api/tenants/acme/limits", json=body).status_code == 401
    done = client.put("/admin/api/tenants/acme/limits", json=body, headers=AUTH)
    assert done.status_code == 200 and done.json() == {"limits": {"tokens_per_minute": 5000, "tokens_per_day": None}}
    bad = client.put("/admin/api/tenants/acme/limits", json={"limits": {"tokens_per_minute": 0}}, headers=AUTH)
    assert bad.status_code == 400
    assert "tokens_per_minute: Input should be greater than 0" in bad.json()["error"]["message"]
    assert client.put("/admin/api/tenants/nobody/limits", json=body, headers=AUTH).status_code == 404
    assert client.put("/admin/api/keys/1/limits", json={"limits": None}, headers=AUTH).json() == {"limits": None}
    events = client.get("/admin/api/audit").json()["events"]
    assert [(e["action"], e["target"], e["actor"]) for e in events[:2]] == [
        ("key.limits", "key:1", "api"), ("tenant.limits", "tenant:acme", "ops")]
    assert client.get("/admin/api/audit", params={"action": "policy."}).json()["events"][0]["action"] == "policy.import"


def test_the_usage_ledger_reads(client: TestClient[Any]) -> None:
    client.app.state.runtime.usage.record(1, 1, "small", 100, 20, 0, 0.5)
    client.app.state.runtime.usage.flush()
    report = client.get("/admin/api/usage", params={"tenant": "acme"}).json()
    assert report["totals"] == {"requests": 1, "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0,
                                "spend": 0.5}
    assert client.get("/admin/api/usage", params={"tenant": "nobody"}).status_code == 404
    assert client.get("/admin/api/usage", params={"since": "2026-13-01"}).status_code == 400
