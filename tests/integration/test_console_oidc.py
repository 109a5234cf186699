"""Console sign-in through an OpenID Connect provider (authorization code + PKCE, roles from a claim),
beside local users, against a small provider run as its own process on loopback (``tests/oidc_provider.py``).

The provider checks what a real one checks (the client, the redirect URI, the code used once, the PKCE
verifier against the S256 challenge), and can be made to send what a broken or hostile one would (another
audience, a wrong nonce, an expired or foreign-signed token, a rotated key, another issuer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
import pytest
from litestar.testing import TestClient

from switchyard.admin.session import SESSION_COOKIE
from switchyard.app import create_app
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.admin_users import create_user, disable_user, list_users, set_password, verify_password
from switchyard.store.audit import list_events
from switchyard.store.errors import StoreError
from tests import oidc_provider
from tests.conftest import SECRETS
from tests.helpers import free_port
from tests.integration.conftest import CONSOLE_PASSWORD, console_login, csrf_headers

REPO = Path(__file__).resolve().parents[2]
CLIENT_ID = "switchyard-console"
CLIENT_SECRET = "idp-client-secret-0b5e7f"
SECRETS.add(CLIENT_SECRET)
ROLES = {"gw-admins": "admin", "gw-operators": "operator", "staff": "viewer"}
CALLBACK = "/admin/login/oidc/callback"


@pytest.fixture(scope="module")
def idp() -> Iterator[str]:
    """The provider's issuer URL (a confidential client with client_secret_basic, until a test says otherwise)."""
    with oidc_provider.running(CLIENT_ID, CLIENT_SECRET) as base:
        yield base


@pytest.fixture
def faults(idp: str) -> Iterator[Callable[..., None]]:
    """Make the provider misbehave (see ``tests/oidc_provider.py``); reset after the test."""

    def set_faults(**what: Any) -> None:
        httpx.post(f"{idp}/control", json=what).raise_for_status()

    yield set_faults
    set_faults()


App = Callable[..., TestClient[Any]]


@pytest.fixture
def console_app(idp: str, tmp_path: Path) -> Iterator[App]:
    """Makes an in-process console whose sign-in goes through the provider (settings can be overridden)."""
    clients: list[TestClient[Any]] = []

    def make(database_url: str | None = None, **overrides: Any) -> TestClient[Any]:
        folder = tmp_path / f"app{len(clients)}"
        folder.mkdir()
        policy = folder / "policies.yaml"
        policy.write_text((REPO / "policies.yaml").read_text())
        options: dict[str, Any] = {
            "data_dir": folder, "database_url": database_url or f"sqlite:///{folder / 'sy.db'}",
            "policy_file": policy, "batch_worker": False, "console_oidc_issuer": idp,
            "console_oidc_client_id": CLIENT_ID, "console_oidc_client_secret": CLIENT_SECRET,
            "console_oidc_roles": ROLES, "console_oidc_label": "Example SSO", **overrides}
        client = TestClient(app=create_app(Settings(**options)))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def sign_in(console: TestClient[Any], username: str, groups: str = "", *, decision: str = "allow",
            next_page: str = "/admin/") -> httpx.Response:
    """Click "Sign in with", fill the provider's login form, follow it back; the callback's answer."""
    start = console.get(f"/admin/login/oidc?next={next_page}", follow_redirects=False)
    assert start.status_code == 303, start.text
    authorize = start.headers["location"]
    assert httpx.get(authorize).status_code == 200  # the provider's login page
    fields = dict(parse_qsl(urlsplit(authorize).query))
    back = httpx.post(authorize.split("?")[0], data={**fields, "username": username, "groups": groups,
                                                     "decision": decision}, follow_redirects=False)
    assert back.status_code == 303
    callback = urlsplit(back.headers["location"])
    assert callback.path == CALLBACK
    return console.get(f"{CALLBACK}?{callback.query}", follow_redirects=False)


def may_add_tenant(console: TestClient[Any], name: str) -> int:
    """The status of an admin's write (creating a tenant) for the signed-in user."""
    return console.post("/admin/tenants", data={"name": name, "tier": "free", "region": ""},
                        headers=csrf_headers(console), follow_redirects=False).status_code


def events(console: TestClient[Any], action: str) -> list[Any]:
    with db.session_scope(console.app.state.runtime.engine) as session:
        return [e for e in list_events(session, limit=200) if e.action == action]


def users(console: TestClient[Any]) -> dict[str, Any]:
    with db.session_scope(console.app.state.runtime.engine) as session:
        return {u.username: u for u in list_users(session)}


def test_the_login_page_offers_the_provider_beside_local_users(console_app: App) -> None:
    console = console_app()
    page = console.get("/admin/login?next=/admin/usage")
    assert page.status_code == 200
    assert "Sign in with Example SSO" in page.text and 'name="password"' in page.text
    assert 'href="/admin/login/oidc?next=/admin/usage"' in page.text


def test_a_first_sign_in_makes_the_user_with_the_role_its_groups_give(console_app: App, idp: str,
                                                                      database_url: str) -> None:
    console = console_app(database_url)
    answer = sign_in(console, "grace", "staff,gw-admins", next_page="/admin/usage")
    assert answer.status_code == 303 and answer.headers["location"] == "/admin/usage"
    cookie = answer.headers.get_list("set-cookie")
    assert any(c.startswith(f"{SESSION_COOKIE}=") and "HttpOnly" in c for c in cookie)
    assert any((c.startswith("switchyard_oidc=") and "Max-Age=0" in c) or 'switchyard_oidc=""' in c for c in cookie)
    page = console.get("/admin/")
    assert page.status_code == 200 and "grace" in page.text
    assert may_add_tenant(console, "grace-co") in (200, 303)
    user = users(console)["grace"]
    assert user.role == "admin" and user.oidc_issuer == idp
    created = events(console, "user.create")[0]
    assert created.detail == {"role": "admin", "via": "oidc", "issuer": idp}
    login = events(console, "user.login")[0]
    assert login.detail["via"] == "oidc" and login.detail["claimed"] == "staff, gw-admins"
    # the provider got the PKCE verifier and the client's credentials in the Authorization header
    token_request = httpx.get(f"{idp}/requests").json()[-1]
    assert token_request["basic"] and not token_request["secret_in_form"]
    assert len(token_request["form"]["code_verifier"]) >= 43
    # the user has no password here: a local login with any password fails
    with db.session_scope(console.app.state.runtime.engine) as session:
        assert verify_password(session, "grace", "") is None
        with pytest.raises(StoreError, match="signs in through"):
            set_password(session, "grace", CONSOLE_PASSWORD, actor="test", origin="test")


def test_the_role_follows_the_claim_at_every_sign_in(console_app: App) -> None:
    console = console_app()
    assert sign_in(console, "hal", "gw-admins").status_code == 303
    console.cookies.clear()
    assert sign_in(console, "hal", "staff").status_code == 303
    assert users(console)["hal"].role == "viewer"
    assert [e.detail for e in events(console, "user.role")] == [{"from": "admin", "to": "viewer", "via": "oidc"}]
    assert console.get("/admin/").status_code == 200
    assert may_add_tenant(console, "hal-co") == 403  # a viewer's session now
    assert len(users(console)) == 1  # the same user (same subject), not a second one


def test_no_mapped_group_is_refused_unless_there_is_a_default_role(console_app: App) -> None:
    console = console_app()
    answer = sign_in(console, "ivan", "interns")
    assert answer.status_code == 403 and "has no console role" in answer.text and "interns" in answer.text
    assert SESSION_COOKIE not in console.cookies and "ivan" not in users(console)
    assert events(console, "user.login_failed")[0].target == "user:ivan"
    fallback = console_app(console_oidc_default_role="viewer")
    assert sign_in(fallback, "ivan", "").status_code == 303
    assert users(fallback)["ivan"].role == "viewer"


def test_with_no_role_table_a_value_that_names_a_role_is_that_role(console_app: App) -> None:
    console = console_app(console_oidc_roles={})
    assert sign_in(console, "uma", "staff,operator").status_code == 303
    assert users(console)["uma"].role == "operator"
    assert sign_in(console_app(console_oidc_roles={}), "vic", "staff").status_code == 403


def test_a_callback_without_its_attempt_or_with_another_state_opens_nothing(console_app: App, idp: str) -> None:
    console = console_app()
    start = console.get("/admin/login/oidc", follow_redirects=False)
    fields = dict(parse_qsl(urlsplit(start.headers["location"]).query))
    back = httpx.post(f"{idp}/authorize", data={**fields, "username": "judy", "groups": "staff",
                                                "decision": "allow"}, follow_redirects=False)
    query = dict(parse_qsl(urlsplit(back.headers["location"]).query))
    forged = console.get(CALLBACK, params={**query, "state": "not-the-state"}, follow_redirects=False)
    assert forged.status_code == 400 and "Sign in again" in forged.text
    other_browser = console_app()  # the code and state, but not the cookie that began the sign-in
    assert other_browser.get(CALLBACK, params=query, follow_redirects=False).status_code == 400
    assert SESSION_COOKIE not in console.cookies and not users(console)


def test_a_code_is_traded_once(console_app: App) -> None:
    console = console_app()
    first = sign_in(console, "kim", "staff")
    assert first.status_code == 303
    used = dict(parse_qsl(urlsplit(str(first.request.url)).query))["code"]
    console.cookies.clear()
    # a new attempt (its own cookie and state) that presents the old code: the provider refuses it
    start = console.get("/admin/login/oidc", follow_redirects=False)
    state = dict(parse_qsl(urlsplit(start.headers["location"]).query))["state"]
    again = console.get(CALLBACK, params={"code": used, "state": state}, follow_redirects=False)
    assert again.status_code == 401 and "invalid_grant" in again.text
    assert SESSION_COOKIE not in console.cookies


@pytest.mark.parametrize(("fault", "said"), [
    ({"nonce": "wrong"}, "nonce"),
    ({"aud": "someone-else"}, "audience"),
    ({"exp": -3600}, "expired"),
    ({"sign": "foreign"}, "signature verification failed"),
])
def test_an_id_token_that_does_not_hold_opens_nothing(console_app: App, faults: Callable[..., None],
                                                      fault: dict[str, Any], said: str) -> None:
    console = console_app()
    faults(**fault)
    answer = sign_in(console, "mallory", "gw-admins")
    assert answer.status_code == 401 and said in answer.text.lower(), answer.text
    assert SESSION_COOKIE not in console.cookies and not users(console)


def test_a_rotated_signing_key_is_read_again(console_app: App, faults: Callable[..., None]) -> None:
    console = console_app()
    assert sign_in(console, "nia", "staff").status_code == 303  # the first key set is now cached
    faults(rotate=True)
    console.cookies.clear()
    assert sign_in(console, "nia", "staff").status_code == 303


def test_roles_from_userinfo_and_client_secret_post(console_app: App, idp: str, faults: Callable[..., None]) -> None:
    faults(groups_in="userinfo", auth_method="client_secret_post")
    console = console_app()
    assert sign_in(console, "olga", "gw-operators").status_code == 303
    assert users(console)["olga"].role == "operator"
    token_request = httpx.get(f"{idp}/requests").json()[-1]
    assert token_request["secret_in_form"] and not token_request["basic"]


def test_a_public_client_signs_in_with_pkce_alone(console_app: App, idp: str, faults: Callable[..., None]) -> None:
    faults(auth_method="none")
    console = console_app(console_oidc_client_secret=None)
    assert sign_in(console, "sam", "staff").status_code == 303
    token_request = httpx.get(f"{idp}/requests").json()[-1]
    assert not token_request["basic"] and not token_request["secret_in_form"]
    assert token_request["form"]["client_id"] == CLIENT_ID and token_request["form"]["code_verifier"]
    # a confidential client whose provider takes no client secret is told so, not sent in the clear anyway
    confidential = console_app()
    answer = sign_in(confidential, "sam", "staff")
    assert answer.status_code == 502 and "client_secret_basic nor client_secret_post" in answer.text


def test_a_local_user_is_never_taken_over_and_a_disabled_one_stays_out(console_app: App) -> None:
    console = console_app()
    with db.session_scope(console.app.state.runtime.engine) as session:
        create_user(session, "ada", CONSOLE_PASSWORD, "viewer", actor="test", origin="test")
    answer = sign_in(console, "ada", "gw-admins")
    assert answer.status_code == 403 and "already exists" in answer.text
    assert users(console)["ada"].role == "viewer" and users(console)["ada"].oidc_issuer is None
    assert console_login(console, "ada").status_code == 303  # her password still works
    console.cookies.clear()
    assert sign_in(console, "pat", "staff").status_code == 303
    with db.session_scope(console.app.state.runtime.engine) as session:
        disable_user(session, "pat", actor="test", origin="test")
    console.cookies.clear()
    refused = sign_in(console, "pat", "staff")
    assert refused.status_code == 403 and "disabled" in refused.text


def test_the_provider_refusing_or_unreachable_is_said_plainly(console_app: App) -> None:
    console = console_app()
    denied = sign_in(console, "quinn", "staff", decision="deny")
    assert denied.status_code == 401 and "access_denied" in denied.text
    gone = console_app(console_oidc_issuer=f"http://127.0.0.1:{free_port()}")
    answer = gone.get("/admin/login/oidc", follow_redirects=False)
    assert answer.status_code == 502 and "did not answer" in answer.text
    assert gone.get("/admin/login").status_code == 200  # local users can still log in


def test_another_issuer_in_discovery_is_refused(console_app: App, faults: Callable[..., None]) -> None:
    faults(issuer="http://evil.example")
    answer = console_app().get("/admin/login/oidc", follow_redirects=False)
    assert answer.status_code == 502 and "names the issuer" in answer.text


def test_logout_ends_a_provider_session_like_a_local_one(console_app: App) -> None:
    console = console_app()
    assert sign_in(console, "rui", "gw-operators").status_code == 303
    assert console.post("/admin/logout", headers=csrf_headers(console), follow_redirects=False).status_code == 303
    assert console.get("/admin/", follow_redirects=False).status_code == 303
