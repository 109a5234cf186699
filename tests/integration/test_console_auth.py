"""Console safety: every admin route wants a session (or, for the JSON API, the admin token), roles are
enforced on the server, CSRF on every write, logins are throttled, and sessions end on logout and
when a user is disabled."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient
from sqlmodel import Session, select

from switchyard.admin.session import SESSION_COOKIE
from switchyard.app import create_app
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.admin_users import (
    DEFAULT_HASH_PROFILE,
    create_user,
    disable_user,
    list_users,
    use_hash_profile,
    verify_password,
)
from switchyard.store.audit import list_events
from switchyard.store.models import AdminUser
from tests.integration.conftest import (
    ADMIN_AUTH,
    CONSOLE_PASSWORD,
    CONSOLE_USERS,
    console_login,
    csrf_headers,
)
from tests.unit.policy.base import base, to_yaml

#: Reachable without logging in: the login form itself.
PUBLIC = {("GET", "/admin/login"), ("POST", "/admin/login")}


def _admin_routes(client: TestClient[Any]) -> list[tuple[str, str]]:
    """Every (method, path) under /admin that the app serves, path parameters filled in."""
    found = []
    for route in client.app.routes:
        if not isinstance(route, HTTPRoute) or not route.path.startswith("/admin"):
            continue
        path = re.sub(r"\{[^}:]+:int\}", "1", route.path)
        path = re.sub(r"\{[^}]+\}", "x", path)
        found += [(m, path) for m in sorted(route.methods) if m not in ("HEAD", "OPTIONS")]
    return found


def test_no_admin_route_is_reachable_without_a_session_or_the_token(console: TestClient[Any]) -> None:
    console.cookies.delete(SESSION_COOKIE)  # logged out; the CSRF cookie stays, so the guard is what answers
    routes = _admin_routes(console)
    assert len(routes) >= 20, routes
    for method, path in routes:
        if (method, path) in PUBLIC:
            continue
        answer = console.request(method, path, headers=csrf_headers(console), follow_redirects=False)
        if path.startswith("/admin/api/"):
            assert answer.status_code == 401, (method, path, answer.status_code)
            assert answer.json()["error"]["code"] == "invalid_admin_token"
        else:
            assert answer.status_code == 303, (method, path, answer.status_code)
            assert answer.headers["location"].startswith("/admin/login?next="), (method, path)
    # htmx is told where to go instead of being handed a login page to swap in
    answer = console.get("/admin/", headers={"HX-Request": "true"}, follow_redirects=False)
    assert answer.status_code == 401 and answer.headers["HX-Redirect"] == "/admin/login"


def test_the_admin_api_takes_the_token_and_never_a_session_cookie(console: TestClient[Any]) -> None:
    assert console.get("/admin/api/endpoints").status_code == 401  # logged in as admin: still no
    assert console.get("/admin/api/endpoints", headers=ADMIN_AUTH).status_code == 200
    wrong = console.get("/admin/api/endpoints", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"


def test_login_sets_an_httponly_samesite_session_cookie_and_the_pages_open(console: TestClient[Any]) -> None:
    console.cookies.clear()
    answer = console_login(console, "viewer")
    assert answer.status_code == 303 and answer.headers["location"] == "/admin/"
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=") and "HttpOnly" in cookie and "SameSite=lax" in cookie
    assert "Secure" not in cookie and "Path=/admin" in cookie
    page = console.get("/admin/")
    assert page.status_code == 200 and CONSOLE_USERS["viewer"] in page.text
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp


def test_behind_tls_the_session_cookie_is_secure(console: TestClient[Any]) -> None:
    console.cookies.clear()
    console.get("/admin/login")
    answer = console.post("/admin/login", data={"username": "vera", "password": CONSOLE_PASSWORD},
                          headers={**csrf_headers(console), "X-Forwarded-Proto": "https"}, follow_redirects=False)
    assert answer.status_code == 303 and "Secure" in answer.headers["set-cookie"]


def test_a_write_without_the_csrf_token_is_refused(console: TestClient[Any]) -> None:
    console.cookies.delete("switchyard_csrf")
    answer = console.post("/admin/logout", follow_redirects=False)
    assert answer.status_code == 403
    assert console.get("/admin/").status_code == 200  # still logged in: the forged logout did nothing
    forged = console.post("/admin/logout", headers={"x-csrftoken": "forged"}, follow_redirects=False)
    assert forged.status_code == 403


def test_the_login_form_needs_the_csrf_token_too(console: TestClient[Any]) -> None:
    console.cookies.clear()
    answer = console.post("/admin/login", data={"username": "ada", "password": CONSOLE_PASSWORD},
                          follow_redirects=False)
    assert answer.status_code == 403


def test_logout_ends_the_session(console: TestClient[Any]) -> None:
    token = console.cookies.get(SESSION_COOKIE)
    answer = console.post("/admin/logout", headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/admin/login"
    console.cookies.set(SESSION_COOKIE, token or "")  # a copy of the old cookie is worth nothing now
    assert console.get("/admin/", follow_redirects=False).status_code == 303


def test_wrong_passwords_are_throttled_per_user_even_with_the_right_one_after(console: TestClient[Any]) -> None:
    console.cookies.clear()
    for _ in range(5):
        answer = console_login(console, "operator", password="not the password")
        assert answer.status_code == 401 and "Wrong username or password" in answer.text
    refused = console_login(console, "operator")
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
    assert console_login(console, "viewer").status_code == 429  # same client address: throttled too
    # Each failed login is on record (who tried, from where; never the password); throttled tries are not.
    with db.session_scope(console.app.state.runtime.engine) as session:
        failed = list_events(session, 50, action="user.login_failed")
    assert len(failed) == 5 and all(e.target == f"user:{CONSOLE_USERS['operator']}" for e in failed)
    assert all(e.origin.startswith("console ") and "not the password" not in str(e.model_dump()) for e in failed)


def test_an_unknown_user_and_a_wrong_password_answer_alike(console: TestClient[Any]) -> None:
    console.cookies.clear()
    unknown = console.post("/admin/login", data={"username": "nobody", "password": "whatever it is"},
                           headers=csrf_headers(console), follow_redirects=False)
    wrong = console_login(console, "viewer", password="whatever it is")
    assert unknown.status_code == wrong.status_code == 401
    assert "Wrong username or password." in unknown.text and "Wrong username or password." in wrong.text


def test_the_next_page_after_login_stays_on_this_console(console: TestClient[Any]) -> None:
    console.cookies.clear()
    for target, expected in (("/admin/policy", "/admin/policy"), ("https://evil.example/", "/admin/"),
                             ("//evil.example/admin/", "/admin/")):
        answer = console.post("/admin/login", data={"username": "vera", "password": CONSOLE_PASSWORD, "next": target},
                              headers=csrf_headers(console), follow_redirects=False)
        assert answer.headers["location"] == expected


def test_a_disabled_user_is_out_at_the_next_request(console: TestClient[Any]) -> None:
    engine = console.app.state.runtime.engine
    with db.session_scope(engine) as session:
        disable_user(session, "ada", actor="test", origin="test")
    assert console.get("/admin/", follow_redirects=False).status_code == 303
    assert console_login(console, "admin").status_code == 401


@pytest.mark.usefixtures("console")
def test_passwords_are_stored_as_argon2id_hashes_only(admin_client: TestClient[Any]) -> None:
    engine = admin_client.app.state.runtime.engine
    with db.session_scope(engine) as session:
        assert {u.username for u in list_users(session)} == set(CONSOLE_USERS.values())
        user = verify_password(session, "ada", CONSOLE_PASSWORD)
        assert user is not None and user.password_hash.startswith("$argon2id$")
        assert CONSOLE_PASSWORD not in user.password_hash
        assert verify_password(session, "ada", CONSOLE_PASSWORD + "x") is None


def test_passwords_are_hashed_with_the_settings_profile_and_rehashed_when_it_changes(tmp_path: Path,
                                                                                      database_url: str) -> None:
    """The default profile is RFC 9106's low-memory one (64 MiB, 3 passes, 4 lanes); a login with a password
    hashed under another profile stores it again under the current one, and still refuses a wrong password."""
    assert Settings.model_fields["password_hash_profile"].default == DEFAULT_HASH_PROFILE == "rfc9106-low-memory"
    policy = tmp_path / "policies.yaml"
    policy.write_text(to_yaml(base()))
    suite = os.environ["SWITCHYARD_PASSWORD_HASH_PROFILE"]
    try:
        settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy,
                            password_hash_profile="rfc9106-low-memory")
        with TestClient(app=create_app(settings)) as client:  # the app applies its settings' profile
            engine = client.app.state.runtime.engine
            with db.session_scope(engine) as session:
                create_user(session, "ada", CONSOLE_PASSWORD, "admin", actor="test", origin="test")
            with db.session_scope(engine) as session:
                assert "$m=65536,t=3,p=4$" in _hash_of(session, "ada")
            use_hash_profile("cheapest")
            with db.session_scope(engine) as session:
                assert verify_password(session, "ada", CONSOLE_PASSWORD + "x") is None
                assert "$m=65536,t=3,p=4$" in _hash_of(session, "ada")  # a refused login changes nothing
                assert verify_password(session, "ada", CONSOLE_PASSWORD) is not None
            with db.session_scope(engine) as session:
                assert "$m=8,t=1,p=1$" in _hash_of(session, "ada")
                assert verify_password(session, "ada", CONSOLE_PASSWORD) is not None
                assert verify_password(session, "nobody", CONSOLE_PASSWORD) is None
    finally:
        use_hash_profile(suite)


def _hash_of(session: Session, username: str) -> str:
    user = session.exec(select(AdminUser).where(AdminUser.username == username)).one()
    return user.password_hash


#: Console POSTs a viewer may make: they change nothing (the CSRF token is still checked).
VIEWER_POSTS = {"/admin/logout", "/admin/dry-run", "/admin/policy/validate"}


def test_every_console_write_names_the_role_it_needs(console: TestClient[Any]) -> None:
    """A new console route that changes something cannot be left open to viewers by forgetting its role."""
    for route in console.app.routes:
        if not isinstance(route, HTTPRoute) or not route.path.startswith("/admin") or \
                route.path.startswith(("/admin/api", "/admin/login")):
            continue
        for handler in route.route_handlers:
            role = (handler.opt or {}).get("role", "viewer")
            if handler.http_methods & {"POST", "PUT", "PATCH", "DELETE"} and route.path not in VIEWER_POSTS:
                assert role in ("operator", "admin"), (route.path, role)


def test_a_viewer_is_refused_every_write(console: TestClient[Any]) -> None:
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    writes = [(m, p) for m, p in _admin_routes(console)
              if m in ("POST", "PUT", "DELETE") and not p.startswith(("/admin/api", "/admin/login"))
              and p not in VIEWER_POSTS]
    assert len(writes) >= 10, writes
    for method, path in writes:
        answer = console.request(method, path, headers=csrf_headers(console), follow_redirects=False)
        assert answer.status_code == 403, (method, path, answer.status_code)
        assert "needs the" in answer.text
