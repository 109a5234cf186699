"""Console pages for tenants, keys, limit overrides and usage (SQLite and PostgreSQL): what they show, what
they change (audited, with the store's functions), what they refuse, and who may do what."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar.testing import TestClient

from switchyard.admin.reveal import REVEAL_COOKIE
from switchyard.decide.admit import Estimate, limit_charges
from switchyard.store import db
from switchyard.store.audit import list_events
from switchyard.store.keys import hash_key, identify, list_keys
from switchyard.store.limits import charges_of
from switchyard.store.models import AuditEventPublic
from switchyard.store.tenants import get_tenant, list_tenants
from tests.integration.conftest import console_login, csrf_headers

SECRET = re.compile(r'<code id="new-key-secret">([^<]+)</code>')


def _post(client: TestClient[Any], path: str, data: dict[str, str] | None = None) -> Any:
    return client.post(path, data=data or {}, headers=csrf_headers(client), follow_redirects=False)


def _events(client: TestClient[Any], action: str | None = None) -> list[AuditEventPublic]:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return list_events(session, 200, action=action)


def _tenant_limits(client: TestClient[Any], name: str) -> dict[str, Any] | None:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return get_tenant(session, name).limits


def _assert_csp_clean(html: str) -> None:
    """No inline style or script: the console's Content-Security-Policy would block them."""
    assert 'style="' not in html and "<style" not in html
    assert all('src="' in tag for tag in re.findall(r"<script[^>]*>", html))
    assert not re.search(r"\son[a-z]+=", html)


def test_a_new_tenant_is_listed_and_audited(console: TestClient[Any]) -> None:
    page = console.get("/admin/tenants")
    assert page.status_code == 200
    assert 'id="tenants"' in page.text and 'id="tenant-acme"' in page.text and 'id="create-tenant-form"' in page.text
    _assert_csp_clean(page.text)

    done = _post(console, "/admin/tenants", {"name": "globex", "tier": "pro", "region": "eu-west"})
    assert done.status_code == 303 and done.headers["location"] == "/admin/tenants/globex"
    listed = console.get("/admin/tenants").text
    row = re.search(r'<tr id="tenant-globex">(.*?)</tr>', listed, re.S)
    assert row is not None and "pro" in row.group(1) and "eu-west" in row.group(1)
    [event] = _events(console, "tenant.create")
    assert (event.actor, event.target, event.detail) == ("console:ada", "tenant:globex",
                                                         {"tier": "pro", "region": "eu-west"})
    assert event.origin.startswith("console ")


def test_bad_input_is_refused_with_an_alert_and_nothing_is_written(console: TestClient[Any]) -> None:
    unknown = _post(console, "/admin/tenants", {"name": "initech", "tier": "platinum"})
    assert unknown.status_code == 400 and 'role="alert"' in unknown.text
    assert "unknown tier &#39;platinum&#39;" in unknown.text and "free, pro" in unknown.text
    assert 'value="initech"' in unknown.text  # the form keeps what was typed
    duplicate = _post(console, "/admin/tenants", {"name": "acme", "tier": "free"})
    assert duplicate.status_code == 409 and "already exists" in duplicate.text
    for name in ("bad name", "", "x" * 65, "../etc"):
        assert _post(console, "/admin/tenants", {"name": name, "tier": "free"}).status_code == 400, name
    assert _post(console, "/admin/tenants", {"name": "initech", "tier": "free", "region": "mars"}).status_code == 400
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert [t.name for t in list_tenants(session)] == ["acme"]
    assert _events(console, "tenant.") == []

    tier = _post(console, "/admin/tenants/acme/tier", {"tier": "platinum"})
    assert tier.status_code == 400 and 'role="alert"' in tier.text and 'id="tier-form"' in tier.text
    for bad in ({"tokens_per_minute": "0"}, {"tokens_per_minute": "lots"}, {"requests_per_minute": "1.5"},
                {"tokens_per_minute": "5000", "tokens_per_day": "100"}):
        limits = _post(console, "/admin/tenants/acme/limits", bad)
        assert limits.status_code == 400 and 'role="alert"' in limits.text, bad
        assert "invalid limits for tenant" in limits.text
    assert _tenant_limits(console, "acme") is None
    assert _post(console, "/admin/tenants/nobody/limits", {"tokens_per_minute": "5"}).status_code == 404
    assert _post(console, "/admin/tenants/nobody/keys").status_code == 404
    assert _post(console, "/admin/keys/999/revoke").status_code == 404
    assert _post(console, "/admin/keys/999/limits", {"tokens_per_minute": "5"}).status_code == 404
    assert console.get("/admin/tenants/nobody").status_code == 404
    assert _events(console, "tenant.") == [] and _events(console, "key.") == []
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert get_tenant(session, "acme").tier == "free"


def test_a_sealed_secret_opens_only_for_its_session(console: TestClient[Any]) -> None:
    posted = _post(console, "/admin/tenants/acme/keys", {"name": "sealed"})
    sealed = posted.cookies.get(REVEAL_COOKIE)
    assert posted.status_code == 303 and sealed and "sk-sy-" not in sealed
    here = "/admin/tenants/acme"
    tampered = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    console.cookies.set(REVEAL_COOKIE, tampered, path=here)
    page = console.get(here)
    assert page.status_code == 200 and 'id="new-key-secret"' not in page.text
    assert REVEAL_COOKIE in page.headers.get("set-cookie", "")  # deleted all the same
    console.cookies.set(REVEAL_COOKIE, sealed, path=here)
    assert SECRET.search(console.get(here).text) is not None
    # Another console session carrying the same cookie sees no secret.
    assert console_login(console, "operator").status_code == 303
    console.cookies.set(REVEAL_COOKIE, sealed, path=here)
    page = console.get(here)
    assert page.status_code == 200 and 'id="new-key-secret"' not in page.text and "sealed" in page.text


def test_a_new_key_is_shown_once_authenticates_and_can_be_revoked(console: TestClient[Any]) -> None:
    engine = console.app.state.runtime.engine
    posted = _post(console, "/admin/tenants/acme/keys", {"name": "ci", "region": "us-east"})
    # Post/redirect/get: the POST's answer is a redirect, and the secret travels sealed, not readable.
    assert posted.status_code == 303 and posted.headers["location"] == "/admin/tenants/acme"
    created = console.get("/admin/tenants/acme")
    assert created.status_code == 200
    assert "it will not be shown again" in created.text
    found = SECRET.search(created.text)
    assert found is not None
    secret = found.group(1)
    assert secret.startswith("sk-sy-")
    assert secret not in str(posted.headers) and secret not in posted.text and secret not in str(created.headers)
    with db.session_scope(engine) as session:
        who = identify(session, hash_key(secret))
        assert who is not None and who.tenant == "acme" and who.region == "us-east"
        key_id = who.key_id
        live = len(list_keys(session, "acme"))
    _assert_csp_clean(created.text)

    # A reload shows the page without the secret, and creates no key.
    page = console.get("/admin/tenants/acme")
    assert page.status_code == 200 and secret not in page.text and 'id="new-key-secret"' not in page.text
    with db.session_scope(engine) as session:
        assert len(list_keys(session, "acme")) == live
    assert f'id="revoke-{key_id}"' in page.text and secret[:12] in page.text  # its prefix tells it apart
    events = _events(console)
    assert all(secret not in json.dumps(e.model_dump(mode="json")) for e in events)
    [event] = _events(console, "key.create")
    assert event.target == f"key:{key_id}" and event.detail["name"] == "ci" and event.actor == "console:ada"

    revoked = _post(console, f"/admin/keys/{key_id}/revoke")
    prefix = secret[:12]
    assert revoked.status_code == 303 and revoked.headers["location"] == f"/admin/tenants/acme?revoked={prefix}"
    note = console.get(revoked.headers["location"]).text  # the page it lands on says what happened
    assert f'id="form-note" class="ok" role="status">Key {prefix}… revoked' in note
    with db.session_scope(engine) as session:
        assert identify(session, hash_key(secret)) is None
        assert [k.revoked_at is not None for k in list_keys(session, "acme")] == [False, True]
    [event] = _events(console, "key.revoke")
    assert event.target == f"key:{key_id}" and event.detail["tenant"] == "acme"
    after = console.get("/admin/tenants/acme").text
    assert f'id="revoke-{key_id}"' not in after and 'id="revoke-1"' in after
    again = _post(console, f"/admin/keys/{key_id}/revoke")
    assert again.status_code == 409 and 'role="alert"' in again.text and "already revoked" in again.text


def test_the_tier_changes_and_is_audited(console: TestClient[Any]) -> None:
    moved = _post(console, "/admin/tenants/acme/tier", {"tier": "pro"})
    assert moved.status_code == 303 and moved.headers["location"] == "/admin/tenants/acme"
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert get_tenant(session, "acme").tier == "pro"
    [event] = _events(console, "tenant.tier")
    assert event.detail == {"tier": "pro", "previous": "free"} and event.target == "tenant:acme"
    page = console.get("/admin/tenants/acme").text
    assert "Per-model limits of tier pro" in page  # pro limits model large to 500 tokens a minute


def test_limit_overrides_are_set_and_cleared(console: TestClient[Any]) -> None:
    done = _post(console, "/admin/tenants/acme/limits", {"tokens_per_minute": "5,000", "tokens_per_day": "none",
                                                           "requests_per_minute": "", "spend_per_month": ""})
    assert done.status_code == 303 and done.headers["location"] == "/admin/tenants/acme"
    assert _tenant_limits(console, "acme") == {"tokens_per_minute": 5000, "tokens_per_day": None}
    page = console.get("/admin/tenants/acme").text
    row = re.search(r'<tr id="limit-tokens_per_minute">(.*?)</tr>', page, re.S)
    assert row is not None and row.group(1).count("5,000") >= 2  # the override and the effective limit
    lifted = re.search(r'<tr id="limit-tokens_per_day">(.*?)</tr>', page, re.S)
    assert lifted is not None and "none (lifted)" in lifted.group(1) and "unlimited" in lifted.group(1)
    assert 'id="limits-tokens_per_minute" name="tokens_per_minute" value="5000"' in page
    assert 'id="limits-tokens_per_day" name="tokens_per_day" value="none"' in page
    listed = console.get("/admin/tenants").text
    assert "tokens per minute 5,000 tokens; tokens per day none" in listed  # one wording, numbers for people
    assert "<th scope=\"row\">tokens per minute</th>" in page and ">tokens_per_minute<" not in page

    assert _post(console, "/admin/tenants/acme/limits", {"clear": "1", "tokens_per_minute": "7"}).status_code == 303
    assert _tenant_limits(console, "acme") is None

    key = _post(console, "/admin/keys/1/limits", {"tokens_per_minute": "300"})
    assert key.status_code == 303 and key.headers["location"] == "/admin/tenants/acme"
    page = console.get("/admin/tenants/acme").text
    key_row = re.search(r'<tr id="key-1">(.*?)</tr>', page, re.S)
    assert key_row is not None and "tokens_per_minute 300" in key_row.group(1)
    assert _post(console, "/admin/keys/1/limits", {"clear": "1"}).status_code == 303
    events = _events(console, "")
    assert [(e.action, e.target, e.actor) for e in events if e.action.endswith(".limits")] == [
        ("key.limits", "key:1", "console:ada"), ("key.limits", "key:1", "console:ada"),
        ("tenant.limits", "tenant:acme", "console:ada"), ("tenant.limits", "tenant:acme", "console:ada")]
    assert events[0].detail == {"limits": None}


def test_the_tenant_page_shows_usage_against_each_limit(console: TestClient[Any]) -> None:
    runtime = console.app.state.runtime
    runtime.usage.record(1, 1, "small", 1200, 300, 0, 0.25)
    runtime.usage.flush()
    # What the gateway reserves for a request of 400 tokens (the same function, the same store).
    snapshot = runtime.policy.snapshot
    charges = limit_charges(snapshot, "free", snapshot.models["small"], Estimate(400, 0, 0.0), tenant="1", key="1")

    async def reserve() -> None:
        await runtime.admitter.store.reserve(charges_of(charges), 60)

    with console.portal() as portal:  # on the app's own event loop
        portal.call(reserve)
    page = console.get("/admin/tenants/acme").text
    day = re.search(r'<tr id="limit-tokens_per_day">(.*?)</tr>', page, re.S)
    assert day is not None and "1,500 tokens today" in day.group(1)
    minute = re.search(r'<tr id="limit-tokens_per_minute">(.*?)</tr>', page, re.S)
    assert minute is not None
    drawn = re.search(r"([\d,]+) of 1,000", minute.group(1))
    assert drawn is not None and 380 <= int(drawn.group(1).replace(",", "")) <= 400
    assert "<meter" in minute.group(1)
    key_row = re.search(r'<tr id="key-1">(.*?)</tr>', page, re.S)
    assert key_row is not None and "1,500" in key_row.group(1)


def test_the_usage_page_shows_the_ledger(console: TestClient[Any]) -> None:
    runtime = console.app.state.runtime
    yesterday = datetime.now(UTC) - timedelta(days=1)
    runtime.usage.record(1, 1, "small", 100, 20, 10, 0.5)
    runtime.usage.record(1, 1, "large", 1000, 200, 0, 2.0)
    runtime.usage.record(1, 1, "small", 50, 5, 0, 0.25, at=yesterday)
    runtime.usage.flush()
    today = datetime.now(UTC).date()

    page = console.get("/admin/usage")
    assert page.status_code == 200
    _assert_csp_clean(page.text)
    assert 'id="usage"' in page.text and 'id="usage-chart"' in page.text
    assert f'id="usage-day-{today}"' in page.text and f'id="usage-day-{yesterday.date()}"' in page.text
    assert 'id="usage-tenant-acme"' in page.text and 'id="usage-model-large"' in page.text
    assert "1,150" in page.text  # prompt tokens over both days
    assert page.text.count("<rect class=\"usage-bar-") >= 4  # yesterday's bars and today's stacked ones
    # 30 days asked, data on the last two: the chart spans the last 7 days, not 30 thin slots
    assert page.text.count('<g class="usage-day">') == 7

    small = console.get("/admin/usage", params={"tenant": "acme", "model": "small", "days": "1"}).text
    row = re.search(rf'<tr id="usage-day-{today}">(.*?)</tr>', small, re.S)
    assert row is not None and ">100<" in row.group(1) and ">10<" in row.group(1) and ">20<" in row.group(1)
    assert f'id="usage-day-{yesterday.date()}"' not in small and 'id="usage-model-large"' not in small

    partial = console.get("/admin/usage", params={"days": "7"},
                          headers={"HX-Request": "true", "HX-Target": "usage-results"})
    assert partial.status_code == 200 and partial.text.lstrip().startswith('<div id="usage-results">')

    unknown = console.get("/admin/usage", params={"tenant": "nobody"})
    assert unknown.status_code == 404 and 'role="alert"' in unknown.text and "no tenant named" in unknown.text
    bad = console.get("/admin/usage", params={"days": "0"})
    assert bad.status_code == 400 and 'role="alert"' in bad.text


def test_a_viewer_reads_every_page_and_changes_nothing(console: TestClient[Any]) -> None:
    assert console_login(console, "viewer").status_code == 303
    for path in ("/admin/tenants", "/admin/tenants/acme", "/admin/usage"):
        page = console.get(path)
        assert page.status_code == 200, path
        assert not re.search(r'<form[^>]*method="post"', page.text.split('<main id="content">')[1]), path
    writes = [("/admin/tenants", {"name": "initech", "tier": "free"}), ("/admin/tenants/acme/tier", {"tier": "pro"}),
              ("/admin/tenants/acme/limits", {"tokens_per_minute": "5"}), ("/admin/tenants/acme/keys", {}),
              ("/admin/keys/1/revoke", {}), ("/admin/keys/1/limits", {"tokens_per_minute": "5"})]
    for path, data in writes:
        assert _post(console, path, data).status_code == 403, path
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert [t.name for t in list_tenants(session)] == ["acme"]
        assert len(list_keys(session, "acme")) == 1 and get_tenant(session, "acme").tier == "free"
    assert _tenant_limits(console, "acme") is None


def test_an_operator_sets_limits_but_makes_no_keys(console: TestClient[Any]) -> None:
    assert console_login(console, "operator").status_code == 303
    page = console.get("/admin/tenants/acme").text
    assert 'id="limits-form"' in page and 'id="create-key-form"' not in page and 'id="revoke-1"' not in page
    assert _post(console, "/admin/tenants/acme/limits", {"tokens_per_minute": "500"}).status_code == 303
    assert _post(console, "/admin/keys/1/limits", {"tokens_per_day": "5000"}).status_code == 303
    assert _tenant_limits(console, "acme") == {"tokens_per_minute": 500}
    for path, data in [("/admin/tenants/acme/keys", {}), ("/admin/keys/1/revoke", {}),
                       ("/admin/tenants", {"name": "initech", "tier": "free"}),
                       ("/admin/tenants/acme/tier", {"tier": "pro"})]:
        assert _post(console, path, data).status_code == 403, path
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert len(list_keys(session, "acme")) == 1
