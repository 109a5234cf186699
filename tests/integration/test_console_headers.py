"""The admin surface, enumerated from the app itself so that a new route cannot be forgotten: CSRF on every
console write, the security headers on every console response (pages, redirects, errors, the login form)
and no inline script anywhere in the console, and the admin token on every admin API route.

The admin API (``/admin/api``) has one credential, the admin token, and no roles: a request has it or is
refused. The console's roles are tested in ``test_console_auth.py``.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient
from sqlalchemy import func
from sqlmodel import select

from switchyard.admin import console as console_module
from switchyard.admin.session import CSRF_COOKIE, CSRF_HEADER, SESSION_COOKIE
from switchyard.app import create_app
from switchyard.resources import static_dir, templates_dir
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.models import AuditEvent
from tests.integration.conftest import ADMIN_AUTH, ADMIN_TOKEN, console_login, csrf_headers
from tests.unit.policy.base import base, to_yaml

WRITES = ("POST", "PUT", "PATCH", "DELETE")


def _fill(path: str) -> str:
    """A route path with its parameters filled in (``1`` for integers, ``x`` otherwise)."""
    return re.sub(r"\{[^}]+\}", "x", re.sub(r"\{[^}:]+:int\}", "1", path))


def _routes(client: TestClient[Any], api: bool) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under ``/admin/api`` (``api``) or else under ``/admin`` (the
    console, its login form included)."""
    found = []
    for route in client.app.routes:
        if not isinstance(route, HTTPRoute) or not route.path.startswith("/admin"):
            continue
        if route.path.startswith("/admin/api") != api:
            continue
        found += [(m, _fill(route.path)) for m in sorted(route.methods) if m not in ("HEAD", "OPTIONS")]
    return found


# --- the security headers of every console response ---------------------------------------------------------


def check_security_headers(response: httpx.Response) -> None:
    """The console's security headers, as they must be on every console response."""
    headers = response.headers
    where = f"{response.request.method} {response.request.url.path} -> {response.status_code}"
    csp = headers.get("content-security-policy")
    assert csp, f"no Content-Security-Policy on {where}"
    directives = {d.split()[0]: d.split()[1:] for d in (p.strip() for p in csp.split(";")) if d}
    assert directives.get("script-src") == ["'self'"], (where, csp)
    assert directives.get("default-src") == ["'self'"], (where, csp)
    assert directives.get("frame-ancestors") == ["'none'"], (where, csp)
    assert directives.get("base-uri") == ["'self'"] and directives.get("form-action") == ["'self'"], (where, csp)
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "*" not in csp, (where, csp)
    assert headers.get("x-content-type-options") == "nosniff", where
    assert headers.get("x-frame-options") == "DENY", where
    assert headers.get("referrer-policy") in ("same-origin", "no-referrer", "strict-origin"), where


#: Inline script in HTML: a script element with a body or without ``src``, an event handler attribute, a
#: ``javascript:`` URL, htmx's ``hx-on`` (which evaluates its value), inline style (CSP blocks it too).
INLINE = {
    "script element without src": re.compile(r"<script(?![^>]*\ssrc=)[^>]*>", re.I),
    "script element with a body": re.compile(r"<script[^>]*>\s*[^<\s]", re.I),
    "event handler attribute": re.compile(r"\son[a-z]+\s*=\s*[\"'{]", re.I),
    "javascript: URL": re.compile(r"javascript:", re.I),
    "hx-on attribute": re.compile(r"\shx-on", re.I),
    "inline style": re.compile(r"<style|\sstyle\s*=", re.I),
}


def inline_script(html: str) -> list[str]:
    """What of :data:`INLINE` ``html`` contains."""
    return [what for what, pattern in INLINE.items() if pattern.search(html)]


@pytest.fixture
def checked(console: TestClient[Any]) -> Iterator[TestClient[Any]]:
    """``console`` (logged in as the admin), every answer to a console path checked for the security headers."""
    seen: list[str] = []

    def hook(response: httpx.Response) -> None:
        path = response.request.url.path
        if (path == "/admin" or path.startswith("/admin/")) and not path.startswith("/admin/api/"):
            check_security_headers(response)
            seen.append(path)

    console.event_hooks["response"].append(hook)
    yield console
    console.event_hooks["response"].remove(hook)
    assert seen  # the hook ran


def test_every_console_page_sends_the_security_headers_and_no_inline_script(checked: TestClient[Any]) -> None:
    pages = [path for method, path in _routes(checked, api=False) if method == "GET"]
    assert len(pages) >= 10 and "/admin/login" in pages, pages
    rendered = 0
    for path in pages:
        for headers in ({}, {"HX-Request": "true"}):
            answer = checked.get(path, headers=headers, follow_redirects=False)
            assert answer.status_code in (200, 303, 404), (path, answer.status_code)
            if answer.headers.get("content-type", "").startswith("text/html"):
                assert not inline_script(answer.text), (path, headers, inline_script(answer.text))
                rendered += answer.status_code == 200
    assert rendered >= 10


def test_redirects_refusals_and_errors_carry_the_security_headers_too(checked: TestClient[Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert checked.get("/admin/nope", follow_redirects=False).status_code == 404  # no route matched
    assert checked.get("/admin/policy/nope/deeper", follow_redirects=False).status_code == 404
    assert checked.delete("/admin/", headers=csrf_headers(checked), follow_redirects=False).status_code == 405
    assert checked.post("/admin/logout", follow_redirects=False).status_code == 403  # no CSRF token
    answer = checked.post("/admin/login", content=b"username=%ff%fe&password=", headers={
        **csrf_headers(checked), "Content-Type": "application/x-www-form-urlencoded"}, follow_redirects=False)
    assert answer.status_code in (400, 401), answer.status_code

    def broken(*_: object) -> dict[str, Any]:
        raise RuntimeError("a bug in a console page")

    monkeypatch.setattr(console_module, "_overview_context", broken)
    assert checked.get("/admin/", follow_redirects=False).status_code == 500
    monkeypatch.undo()
    # A viewer's refusal, and everything a logged-out browser gets.
    checked.cookies.clear()
    assert console_login(checked, "viewer").status_code == 303
    writes = [(m, p) for m, p in _routes(checked, api=False) if m in WRITES and p.startswith("/admin/tenants")]
    assert writes
    assert checked.request(writes[0][0], writes[0][1], headers=csrf_headers(checked),
                           follow_redirects=False).status_code == 403
    checked.cookies.delete(SESSION_COOKIE)
    for method, path in _routes(checked, api=False):
        checked.request(method, path, headers=csrf_headers(checked), follow_redirects=False)
    answer = checked.get("/admin/", headers={"HX-Request": "true"}, follow_redirects=False)
    assert answer.status_code == 401


def test_no_console_template_has_inline_script() -> None:
    templates = sorted(p for p in templates_dir().rglob("*") if p.is_file())
    assert len(templates) >= 20, templates
    for template in templates:
        text = template.read_text()
        assert not inline_script(text), (template, inline_script(text))
    base_page = (templates_dir() / "base.html.j2").read_text()
    # The scripts are htmx (told to evaluate nothing) and the console's own few lines, both served by the gateway.
    assert re.findall(r"<script[^>]*>", base_page) == ['<script src="/static/htmx-2.0.11.min.js" defer>',
                                                      '<script src="/static/console.js" defer>']
    own = (static_dir() / "console.js").read_text()
    assert "eval(" not in own and "innerHTML" not in own and "new Function" not in own
    assert '"allowEval": false' in base_page and '"allowScriptTags": false' in base_page
    assert '"includeIndicatorStyles": false' in base_page
    assert {p.suffix for p in Path(static_dir()).iterdir()} <= {".js", ".css", ".LICENSE"}


def test_the_checks_catch_what_they_look_for() -> None:
    """The patterns find what they must (so the tests above can fail)."""
    for html in ('<script>alert(1)</script>', '<script type="module">', '<script src="/x.js">go()</script>',
                 '<button onclick="go()">', "<a href='javascript:go()'>", '<div hx-on:click="go()">',
                 '<p style="color: red">', "<style>p {}</style>"):
        assert inline_script(html), html
    assert not inline_script('<script src="/static/htmx.js" defer></script><a href="/admin/" class="on">')


# --- CSRF on every console write ----------------------------------------------------------------------------


def _audit_rows(client: TestClient[Any]) -> int:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return int(session.exec(select(func.count()).select_from(AuditEvent)).one())


def test_every_console_write_refuses_a_request_without_the_csrf_token(checked: TestClient[Any]) -> None:
    """Logged in as the admin (so the role is never what refuses), every console write is refused without the
    CSRF token, with a forged one, and with the header but not the cookie; nothing is changed."""
    writes = [(m, p) for m, p in _routes(checked, api=False) if m in WRITES]
    assert len(writes) >= 15 and ("POST", "/admin/login") in writes, writes
    token = checked.cookies[CSRF_COOKIE]
    audit = _audit_rows(checked)
    for method, path in writes:
        for headers in ({}, {CSRF_HEADER: "forged"}, {CSRF_HEADER: token + "x"}):
            answer = checked.request(method, path, headers=headers, data={"username": "ada"},
                                     follow_redirects=False)
            assert answer.status_code == 403, (method, path, headers, answer.status_code)
    checked.cookies.delete(CSRF_COOKIE)
    for method, path in writes:
        answer = checked.request(method, path, headers={CSRF_HEADER: token}, follow_redirects=False)
        assert answer.status_code == 403, (method, path, "no cookie", answer.status_code)
    checked.cookies.set(CSRF_COOKIE, token)
    assert _audit_rows(checked) == audit  # nothing was changed
    assert checked.get("/admin/", follow_redirects=False).status_code == 200  # and the session is still live


def test_every_console_write_has_its_token_checked_even_without_a_session(console: TestClient[Any]) -> None:
    """No state change is ever reached without a token, logged in or not (the login form included)."""
    console.cookies.delete(SESSION_COOKIE)
    for method, path in _routes(console, api=False):
        if method in WRITES:
            answer = console.request(method, path, follow_redirects=False)
            assert answer.status_code == 403, (method, path, answer.status_code)


# --- the admin token on every admin API route ---------------------------------------------------------------


def test_every_admin_api_route_refuses_a_missing_or_wrong_token(console: TestClient[Any]) -> None:
    routes = _routes(console, api=True)
    assert len(routes) >= 8, routes
    basic = base64.b64encode(f"admin:{ADMIN_TOKEN}".encode()).decode()
    wrong: list[dict[str, str]] = [
        {}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"}, {"Authorization": "Bearer "}, {"Authorization": ADMIN_TOKEN},
        {"Authorization": f"Basic {basic}"}, {"Authorization": f"Token {ADMIN_TOKEN}"},
        {"X-Admin-Token": ADMIN_TOKEN, "X-Api-Key": ADMIN_TOKEN},
    ]
    for method, path in routes:
        for headers in wrong:
            # The console session cookie (an admin's) and its CSRF token ride along: they are worth nothing here.
            answer = console.request(method, path, params={"token": ADMIN_TOKEN, "access_token": ADMIN_TOKEN},
                                     headers={**csrf_headers(console), **headers}, json={})
            assert answer.status_code == 401, (method, path, headers, answer.status_code)
            assert answer.json()["error"]["code"] == "invalid_admin_token"
            assert answer.headers["WWW-Authenticate"] == "Bearer"
        answer = console.request(method, path, headers=ADMIN_AUTH, json={})
        assert answer.status_code not in (401, 403), (method, path, answer.status_code)


def test_without_an_admin_token_every_admin_api_route_is_disabled(tmp_path: Path, database_url: str) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(to_yaml(base()))
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy)
    with TestClient(app=create_app(settings)) as client:
        routes = _routes(client, api=True)
        assert len(routes) >= 8
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer none"}):
                answer = client.request(method, path, headers=headers, json={})
                assert answer.status_code == 403, (method, path, headers, answer.status_code)
                assert answer.json()["error"]["code"] == "admin_api_disabled"
