"""Who is using the console: session cookies, roles on every route, login throttling, CSRF settings
and the security headers of console pages.

Every console route sits behind the guard :func:`console_guard` makes: no session, no page (a
browser is sent to the login form, htmx gets ``HX-Redirect``). A route's ``opt={"role": ...}``
names the least role that may use it (``viewer`` when unset). The JSON admin API (``/admin/api``)
does not take cookies at all: it wants the admin token (:func:`switchyard.admin.common.admin_token_guard`),
so no browser can be tricked into calling it and it needs no CSRF token. Console forms and htmx
writes carry Litestar's CSRF token (double-submit cookie signed with the console secret).

The security headers go on every console response however it was made (a page, a guard's redirect, a
refused CSRF check, an unknown path, a validation or server error): :func:`console_security_headers` is
a ``before_send`` hook of the whole app.
"""

from __future__ import annotations

import collections
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio.to_thread
from litestar import Request, Response
from litestar.config.csrf import CSRFConfig
from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers import BaseRouteHandler
from litestar.response import Redirect, Template
from litestar.types import ExceptionHandlersMap, Guard, Message, Scope
from sqlalchemy import Engine

from switchyard.settings import Settings
from switchyard.store.admin_users import RANK, ConsoleUser, session_user
from switchyard.store.db import session_scope

SESSION_COOKIE = "switchyard_session"
CSRF_COOKIE = "switchyard_csrf"
CSRF_HEADER = "x-csrftoken"
LOGIN_PATH = "/admin/login"

#: Sent with every console page: only this origin's scripts and styles (htmx is served locally and
#: no page needs inline script), no framing, forms post only here.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'self'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def console_secret(settings: Settings) -> str:
    """The CSRF signing secret: the setting, else one made once and kept (mode 600) in the data dir."""
    if settings.console_secret is not None:
        return settings.console_secret.get_secret_value()
    path = Path(settings.data_dir) / "console-secret"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def csrf_config(settings: Settings) -> CSRFConfig:
    """CSRF on every state-changing console request; the OpenAI API and the token-only admin API are
    exempt (neither accepts cookies, so a forged cross-site request carries no credentials)."""
    return CSRFConfig(secret=console_secret(settings), cookie_name=CSRF_COOKIE, header_name=CSRF_HEADER,
                      cookie_secure=bool(settings.console_secure_cookies), cookie_httponly=True,
                      cookie_samesite="strict", exclude=["^/v1/", "^/admin/api/", "^/(de)?tokenize$"])


def secure_request(settings: Settings, connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether cookies set on this request should be Secure."""
    if settings.console_secure_cookies is not None:
        return settings.console_secure_cookies
    forwarded = connection.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return connection.url.scheme == "https" or forwarded == "https"


def console_guard(db: Callable[[], Engine]) -> Guard:
    """The guard of every console route: a request goes through only with a live session (looked up in the
    database ``db`` gives) whose role includes the route's."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        token = connection.cookies.get(SESSION_COOKIE)
        user: ConsoleUser | None = None
        if token:
            engine = db()

            def lookup() -> ConsoleUser | None:
                with session_scope(engine) as session:
                    return session_user(session, token)

            user = await anyio.to_thread.run_sync(lookup)
        if user is None:
            raise NotAuthorizedException("log in to use the console")
        connection.state.console_user = user
        needed = str((handler.opt or {}).get("role", "viewer"))
        if RANK[user.role] < RANK[needed]:
            raise PermissionDeniedException(f"this needs the {needed} role; {user.username} is a {user.role}")

    return guard


def current_user(request: Request[Any, Any, Any]) -> ConsoleUser:
    """The user the console's guard (:func:`console_guard`) let in."""
    user: ConsoleUser = request.state.console_user
    return user


def console_origin(request: Request[Any, Any, Any]) -> tuple[str, str]:
    """(actor, origin) of a console change, for the audit log."""
    host = request.client.host if request.client is not None else "?"
    return f"console:{current_user(request).username}", f"console {host}"


def _not_logged_in(request: Request[Any, Any, Any], exc: NotAuthorizedException) -> Response[Any]:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    login = f"{LOGIN_PATH}?next={quote(target, safe='/')}"
    if request.headers.get("hx-request") == "true":
        return Response(content=exc.detail, status_code=401, media_type="text/plain",
                        headers={"HX-Redirect": LOGIN_PATH, **SECURITY_HEADERS})
    return Redirect(path=login, status_code=303, headers=SECURITY_HEADERS)


def _forbidden(request: Request[Any, Any, Any], exc: PermissionDeniedException) -> Response[Any]:
    return Template(template_name="admin/forbidden.html.j2", status_code=403, headers=SECURITY_HEADERS,
                    context={"reason": exc.detail, "user": getattr(request.state, "console_user", None)})


CONSOLE_EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    NotAuthorizedException: _not_logged_in,
    PermissionDeniedException: _forbidden,
}


async def security_headers(response: Response[Any]) -> Response[Any]:
    """After-request hook of the console routers."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def is_console_path(path: str) -> bool:
    """Whether ``path`` is the console's: under ``/admin`` but not the JSON admin API."""
    return (path == "/admin" or path.startswith("/admin/")) and not (path == "/admin/api"
                                                                     or path.startswith("/admin/api/"))


async def console_security_headers(message: Message, scope: Scope) -> None:
    """``before_send`` hook of the app: :data:`SECURITY_HEADERS` on every response to a console path that does
    not set them itself, whatever answered it (even a request no console route matched)."""
    if message["type"] != "http.response.start" or scope["type"] != ScopeType.HTTP:
        return
    if not is_console_path(scope["path"]):
        return
    headers = MutableScopeHeaders.from_message(message)
    for name, value in SECURITY_HEADERS.items():
        if name not in headers:
            headers[name] = value


class LoginThrottle:
    """Failed logins per username and per client address over a sliding window (in this process).

    After ``attempts`` failures for either key in ``window_s``, further tries are refused until the
    oldest failure leaves the window — with the right password too, so a guesser learns nothing.
    """

    def __init__(self, attempts: int, window_s: float, max_keys: int = 10_000) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self.max_keys = max_keys
        self._failures: dict[str, collections.deque[float]] = {}

    def _recent(self, key: str, now: float) -> collections.deque[float]:
        failures = self._failures.get(key)
        if failures is None:
            return collections.deque()
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        if not failures:
            del self._failures[key]
        return failures

    def retry_after(self, keys: tuple[str, ...], now: float | None = None) -> float:
        """Seconds until a login may be tried for these keys (0: now)."""
        now = time.monotonic() if now is None else now
        wait = 0.0
        for key in keys:
            failures = self._recent(key, now)
            if len(failures) >= self.attempts:
                wait = max(wait, failures[len(failures) - self.attempts] + self.window_s - now)
        return wait

    def failed(self, keys: tuple[str, ...], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if len(self._failures) >= self.max_keys:  # bounded memory under a spray of names
            self._failures.pop(next(iter(self._failures)))
        for key in keys:
            self._failures.setdefault(key, collections.deque()).append(now)

    def succeeded(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self._failures.pop(key, None)
