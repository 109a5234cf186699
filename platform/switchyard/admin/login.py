"""Console login and logout (the login form's router, :func:`login_router`; logout is a console page)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

import anyio.to_thread
from litestar import Request, Response, Router, get, post
from litestar.datastructures import Cookie
from litestar.di import NamedDependency, Provide
from litestar.enums import RequestEncodingType
from litestar.params import Body, QueryParameter
from litestar.response import Redirect, Template
from msgspec import Struct
from sqlalchemy import Engine

from switchyard.admin.dependencies import AdminDependencies
from switchyard.admin.session import (
    CONSOLE_EXCEPTION_HANDLERS,
    LOGIN_PATH,
    SECURITY_HEADERS,
    SESSION_COOKIE,
    LoginThrottle,
    current_user,
    secure_request,
    security_headers,
)
from switchyard.settings import Settings
from switchyard.store.admin_users import close_session, open_session, verify_password
from switchyard.store.audit import append_event
from switchyard.store.db import session_scope


class LoginForm(Struct):
    username: str = ""
    password: str = ""
    next: str = "/admin/"


def _safe_next(target: str) -> str:
    """Only a console path of this site (no open redirect to another host)."""
    if target.startswith("/admin/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/admin/"


def _form(next_: str, error: str | None = None, username: str = "", status: int = 200,
          headers: dict[str, str] | None = None) -> Template:
    return Template(template_name="admin/login.html.j2", status_code=status, headers={**SECURITY_HEADERS,
                    **(headers or {})}, context={"next": _safe_next(next_), "error": error, "username": username})


@get(LOGIN_PATH, name="admin:login", include_in_schema=False)
async def login_form(next_page: Annotated[str, QueryParameter(name="next")] = "/admin/") -> Template:
    """The login form."""
    return _form(next_page)


@post(LOGIN_PATH, include_in_schema=False)
async def login(request: Request[Any, Any, Any],
                data: Annotated[LoginForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
                settings: NamedDependency[Settings], db: NamedDependency[Engine],
                throttle: NamedDependency[LoginThrottle]) -> Response[Any]:
    """Check the password (rate-limited per username and per address); on success set the session cookie."""
    client = request.client.host if request.client is not None else "?"
    keys = (f"user:{data.username.lower()}", f"addr:{client}")
    wait = throttle.retry_after(keys)
    if wait > 0:
        return _form(data.next, f"Too many failed logins. Try again in {int(wait) + 1} s.", data.username,
                     status=429, headers={"Retry-After": str(int(wait) + 1)})

    def check() -> str | None:
        with session_scope(db) as session:
            user = verify_password(session, data.username, data.password)
            if user is None:  # on record (the throttle bounds how many): who tried, from where
                name = data.username[:64]
                append_event(session, actor=f"console:{name}", origin=f"console {client}"[:128],
                             action="user.login_failed", target=f"user:{name}",
                             detail={"reason": "wrong username or password"})
                return None
            return open_session(session, user, timedelta(seconds=settings.console_session_ttl_s), client)

    token = await anyio.to_thread.run_sync(check)
    if token is None:
        throttle.failed(keys)
        return _form(data.next, "Wrong username or password.", data.username, status=401)
    throttle.succeeded(keys[:1])
    cookie = Cookie(key=SESSION_COOKIE, value=token, path="/admin", httponly=True, samesite="lax",
                    secure=secure_request(settings, request),
                    max_age=int(settings.console_session_ttl_s))
    return Redirect(path=_safe_next(data.next), status_code=303, cookies=[cookie], headers=SECURITY_HEADERS)


@post("/logout", name="admin:logout", include_in_schema=False)
async def logout(request: Request[Any, Any, Any], db: NamedDependency[Engine]) -> Response[Any]:
    """End this session everywhere and go back to the login form."""
    token = request.cookies.get(SESSION_COOKIE, "")
    current_user(request)  # the guard let a live session in

    def close() -> None:
        with session_scope(db) as session:
            close_session(session, token)

    await anyio.to_thread.run_sync(close)
    response = Redirect(path=LOGIN_PATH, status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(SESSION_COOKIE, path="/admin")
    return response


def login_router(dependencies: AdminDependencies) -> Router:
    """The login form's routes (outside the console's guard), given ``dependencies`` and this app's login
    throttle (failed logins are counted per process)."""
    settings = dependencies.settings
    throttle = LoginThrottle(settings.console_login_attempts, settings.console_login_window_s)
    return Router(path="/", route_handlers=[login_form, login], after_request=security_headers,
                  exception_handlers=CONSOLE_EXCEPTION_HANDLERS,
                  dependencies={**dependencies.providers(),
                                "throttle": Provide(lambda: throttle, use_cache=True, sync_to_thread=False)})
