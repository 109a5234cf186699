"""The admin API for limit overrides, the usage ledger and the audit log (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

from litestar.testing import TestClient

from tests.integration.conftest import ADMIN_AUTH as AUTH


def test_overrides_need_the_token_are_validated_and_audited(admin_client: TestClient[Any]) -> None:
    body = {"limits": {"tokens_per_minute": 5000, "tokens_per_day": None}, "author": "ops"}
    assert admin_client.put("/admin/api/tenants/acme/limits", json=body).status_code == 401
    done = admin_client.put("/admin/api/tenants/acme/limits", json=body, headers=AUTH)
    assert done.status_code == 200 and done.json() == {"limits": {"tokens_per_minute": 5000, "tokens_per_day": None}}
    bad = admin_client.put("/admin/api/tenants/acme/limits", json={"limits": {"tokens_per_minute": 0}}, headers=AUTH)
    assert bad.status_code == 400
    assert "tokens_per_minute: Input should be greater than 0" in bad.json()["error"]["message"]
    assert admin_client.put("/admin/api/tenants/nobody/limits", json=body, headers=AUTH).status_code == 404
    assert admin_client.put("/admin/api/keys/1/limits", json={"limits": None}, headers=AUTH).json() == {"limits": None}
    events = admin_client.get("/admin/api/audit", headers=AUTH).json()["events"]
    assert [(e["action"], e["target"], e["actor"]) for e in events[:2]] == [
        ("key.limits", "key:1", "api"), ("tenant.limits", "tenant:acme", "ops")]
    policy_events = admin_client.get("/admin/api/audit", params={"action": "policy."}, headers=AUTH).json()["events"]
    assert policy_events[0]["action"] == "policy.import"


def test_the_usage_ledger_reads(admin_client: TestClient[Any]) -> None:
    admin_client.app.state.runtime.usage.record(1, 1, "small", 100, 20, 0, 0.5)
    admin_client.app.state.runtime.usage.flush()
    report = admin_client.get("/admin/api/usage", params={"tenant": "acme"}, headers=AUTH).json()
    assert report["totals"] == {"requests": 1, "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0,
                                "spend": 0.5}
    assert admin_client.get("/admin/api/usage", params={"tenant": "nobody"}, headers=AUTH).status_code == 404
    assert admin_client.get("/admin/api/usage", params={"since": "2026-13-01"}, headers=AUTH).status_code == 400
