"""Console login and logout (the login form's router, :func:`login_router`; logout is a console page).

Two ways in, side by side: a local user's password, and (when ``console_oidc_issuer`` is set) the
organisation's identity provider through OpenID Connect (:mod:`switchyard.admin.oidc`): the login page's
"Sign in with ..." sends the browser to the provider with a sign-in attempt sealed in a cookie; the
provider sends it back to the callback, which checks the attempt, trades the code, and opens the same
kind of console session a password does for the user the provider vouched for (made on the first
sign-in, its role set from the provider's claim at every sign-in).
"""

from __future__ import annotations

import logging
import secrets
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
from switchyard.admin.oidc import Attempt, Identity, NoRole, OidcClient, SignInError
from switchyard.admin.sealed import seal, unseal
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
from switchyard.store.admin_users import (
    SignInRefused,
    close_session,
    open_session,
    sso_user,
    use_hash_profile,
    verify_password,
)
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


log = logging.getLogger("switchyard.console")

OIDC_PATH = "/admin/login/oidc"
OIDC_CALLBACK_PATH = "/admin/login/oidc/callback"
OIDC_COOKIE = "switchyard_oidc"
#: How long a sign-in at the provider may take (the sealed attempt's life).
OIDC_ATTEMPT_TTL_S = 600
_ATTEMPT = "oidc-attempt"


def _form(settings: Settings, next_: str, error: str | None = None, username: str = "", status: int = 200,
          headers: dict[str, str] | None = None) -> Template:
    sso = settings.console_oidc_label if settings.console_oidc_issuer is not None else None
    return Template(template_name="admin/login.html.j2", status_code=status, headers={**SECURITY_HEADERS,
                    **(headers or {})}, context={"next": _safe_next(next_), "error": error, "username": username,
                                                 "sso": sso, "sso_path": OIDC_PATH})


@get(LOGIN_PATH, name="admin:login", include_in_schema=False)
async def login_form(settings: NamedDependency[Settings],
                     next_page: Annotated[str, QueryParameter(name="next")] = "/admin/") -> Template:
    """The login form."""
    return _form(settings, next_page)


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
        return _form(settings, data.next, f"Too many failed logins. Try again in {int(wait) + 1} s.", data.username,
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
        return _form(settings, data.next, "Wrong username or password.", data.username, status=401)
    throttle.succeeded(keys[:1])
    return _logged_in(settings, request, token, data.next)


def _logged_in(settings: Settings, request: Request[Any, Any, Any], token: str, next_: str) -> Redirect:
    cookie = Cookie(key=SESSION_COOKIE, value=token, path="/admin", httponly=True, samesite="lax",
                    secure=secure_request(settings, request),
                    max_age=int(settings.console_session_ttl_s))
    return Redirect(path=_safe_next(next_), status_code=303, cookies=[cookie], headers=SECURITY_HEADERS)


@get(OIDC_PATH, name="admin:oidc", include_in_schema=False)
async def oidc_start(request: Request[Any, Any, Any], settings: NamedDependency[Settings],
                     oidc: NamedDependency[OidcClient],
                     next_page: Annotated[str, QueryParameter(name="next")] = "/admin/") -> Response[Any]:
    """Send the browser to the identity provider, with this sign-in attempt sealed in a cookie."""
    redirect_uri = settings.console_oidc_redirect_url or request.url_for("admin:oidc-callback")
    try:
        attempt, url = await oidc.start(_safe_next(next_page), redirect_uri)
    except SignInError as e:
        log.warning("console sign-in through %s cannot start: %s", oidc.issuer, e)
        return _form(settings, next_page, f"Sign-in through the identity provider is not available: {e}",
                     status=e.status)
    # SameSite=Lax: the provider's redirect back is a top-level cross-site GET, which Lax lets the cookie ride
    cookie = Cookie(key=OIDC_COOKIE, value=seal(settings, _ATTEMPT, attempt.as_dict(), b"", OIDC_ATTEMPT_TTL_S),
                    path=OIDC_PATH, httponly=True, samesite="lax", secure=secure_request(settings, request),
                    max_age=OIDC_ATTEMPT_TTL_S)
    return Redirect(path=url, status_code=303, cookies=[cookie], headers=SECURITY_HEADERS)


@get(OIDC_CALLBACK_PATH, name="admin:oidc-callback", include_in_schema=False)
async def oidc_callback(request: Request[Any, Any, Any], settings: NamedDependency[Settings],
                        db: NamedDependency[Engine], oidc: NamedDependency[OidcClient],
                        code: Annotated[str | None, QueryParameter()] = None,
                        given_state: Annotated[str | None, QueryParameter(name="state")] = None,
                        error: Annotated[str | None, QueryParameter()] = None,
                        error_description: Annotated[str | None, QueryParameter()] = None) -> Response[Any]:
    """Where the provider sends the browser back: check the attempt, trade the code, open a console session."""
    client = request.client.host if request.client is not None else "?"
    sealed = unseal(settings, _ATTEMPT, request.cookies.get(OIDC_COOKIE), b"")
    attempt = Attempt.from_dict(sealed) if sealed is not None else None

    def refused(message: str, status: int) -> Response[Any]:
        response = _form(settings, attempt.next if attempt else "/admin/", message, status=status)
        response.delete_cookie(OIDC_COOKIE, path=OIDC_PATH)
        return response

    if error is not None:
        said = f"{error}" + (f" ({error_description})" if error_description else "")
        return refused(f"The identity provider did not sign you in: {said[:300]}", 401)
    if attempt is None or given_state is None or not secrets.compare_digest(given_state, attempt.state):
        return refused("This sign-in expired or was begun in another browser or tab. Sign in again.", 400)
    if not code:
        return refused("The identity provider sent no authorization code. Sign in again.", 400)
    try:
        identity = await oidc.finish(attempt, code)
    except SignInError as e:
        log.warning("console sign-in through %s refused: %s", oidc.issuer, e)
        if isinstance(e, NoRole):  # someone the provider knows, kept out by the role table: on record
            await anyio.to_thread.run_sync(_audit_refusal, db, e.username, client, str(e))
        return refused(f"Sign-in failed: {e}", e.status)

    def open_it(who: Identity) -> str:
        with session_scope(db) as session:
            user = sso_user(session, issuer=who.issuer, subject=who.subject, username=who.username,
                            role=who.role, client=client)
            return open_session(session, user, timedelta(seconds=settings.console_session_ttl_s), client,
                                {"via": "oidc", "issuer": who.issuer, "claimed": ", ".join(who.claimed)[:200]})

    try:
        token = await anyio.to_thread.run_sync(open_it, identity)
    except SignInRefused as e:
        await anyio.to_thread.run_sync(_audit_refusal, db, identity.username, client, str(e))
        return refused(f"Sign-in failed: {e}", 403)
    response = _logged_in(settings, request, token, attempt.next)
    response.delete_cookie(OIDC_COOKIE, path=OIDC_PATH)
    return response


def _audit_refusal(db: Engine, username: str, client: str, reason: str) -> None:
    with session_scope(db) as session:
        name = username[:64]
        append_event(session, actor=f"console:{name}", origin=f"console {client}"[:128], action="user.login_failed",
                     target=f"user:{name}", detail={"reason": reason[:300], "via": "oidc"})


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
    throttle (failed logins are counted per process). This process hashes passwords with the settings' profile."""
    settings = dependencies.settings
    use_hash_profile(settings.password_hash_profile)
    throttle = LoginThrottle(settings.console_login_attempts, settings.console_login_window_s)
    handlers: list[Any] = [login_form, login]
    providers = {**dependencies.providers(),
                 "throttle": Provide(lambda: throttle, use_cache=True, sync_to_thread=False)}
    if settings.console_oidc_issuer is not None:  # the routes exist only when a provider is configured
        oidc = OidcClient(settings)
        handlers += [oidc_start, oidc_callback]
        providers["oidc"] = Provide(lambda: oidc, use_cache=True, sync_to_thread=False)
    return Router(path="/", route_handlers=handlers, after_request=security_headers,
                  exception_handlers=CONSOLE_EXCEPTION_HANDLERS, dependencies=providers)
