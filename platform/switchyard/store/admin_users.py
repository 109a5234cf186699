"""Console users and their login sessions.

Passwords are hashed with argon2id and never stored or logged otherwise: by default with ``argon2-cffi``'s
defaults (RFC 9106's low-memory profile: 64 MiB, 3 passes, about 0.1 s), or another of :data:`HASH_PROFILES`
(``SWITCHYARD_PASSWORD_HASH_PROFILE``, applied by :func:`use_hash_profile`); a login with a password hashed
under other parameters stores it again under the current ones. A session is a random 256-bit token in an
HttpOnly cookie; the database keeps only its sha256 (like API keys: a random token needs no slow hash), so
sessions work on every gateway replica and a logout or a disabled user ends them everywhere at the next request.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, get_args

from argon2 import Parameters, PasswordHasher, profiles
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from sqlmodel import Session, col, delete, select

from switchyard.store.audit import append_event
from switchyard.store.errors import Conflict, NotFound, StoreError
from switchyard.store.models import AdminSession, AdminUser, AdminUserPublic, utcnow

Role = Literal["viewer", "operator", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
#: What each role may do includes everything the roles before it may.
RANK: dict[str, int] = {role: rank for rank, role in enumerate(ROLES)}
USERNAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"
MIN_PASSWORD_LENGTH = 12

#: The argon2id parameters a process may hash passwords with, by name: RFC 9106's two recommendations, and
#: argon2-cffi's cheapest (8 KiB, one pass: made for test suites, which log in hundreds of times; never for a
#: console anyone can reach).
HASH_PROFILES: dict[str, Parameters] = {"rfc9106-low-memory": profiles.RFC_9106_LOW_MEMORY,
                                        "rfc9106-high-memory": profiles.RFC_9106_HIGH_MEMORY,
                                        "cheapest": profiles.CHEAPEST}
DEFAULT_HASH_PROFILE = "rfc9106-low-memory"

_profile = DEFAULT_HASH_PROFILE
_hasher = PasswordHasher.from_parameters(HASH_PROFILES[_profile])


def use_hash_profile(name: str) -> None:
    """Hash this process's new and rehashed passwords with the parameters of profile ``name``."""
    global _hasher, _profile
    if name != _profile:
        _hasher, _profile = PasswordHasher.from_parameters(HASH_PROFILES[name]), name
        _dummy_hash.cache_clear()  # an unknown name is checked at the same cost as a known one


@functools.cache
def _dummy_hash() -> str:
    """Verified against when the username is unknown, so that a wrong name costs the same time as a wrong password.

    Made on first use, not at import: an argon2id hash takes about 0.1 s by design, and every process that
    imports the store (the gateway, each CLI command) paid it at start.
    """
    return _hasher.hash(secrets.token_urlsafe(16))


@dataclass(frozen=True, slots=True)
class ConsoleUser:
    """Who a valid session speaks for."""

    id: int
    username: str
    role: Role
    session_id: int

    def may(self, role: str) -> bool:
        """True when this user's role includes ``role``."""
        return RANK[self.role] >= RANK[role]


def _check_role(role: str) -> Role:
    if role not in RANK:
        raise StoreError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return role  # type: ignore[return-value]


def _check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise StoreError(f"a password needs at least {MIN_PASSWORD_LENGTH} characters")


def _public(user: AdminUser) -> AdminUserPublic:
    return AdminUserPublic.model_validate(user)


def _user(session: Session, username: str) -> AdminUser:
    user = session.exec(select(AdminUser).where(AdminUser.username == username)).first()
    if user is None:
        raise NotFound(f"no console user {username!r}")
    return user


def create_user(session: Session, username: str, password: str, role: str, *, actor: str,
                origin: str) -> AdminUserPublic:
    """Add a console user (audited; the password itself is never in the audit entry)."""
    if not re.fullmatch(USERNAME_PATTERN, username):
        raise StoreError("a username is 1-64 letters, digits and . _ @ - (starting with a letter or digit)")
    checked = _check_role(role)
    _check_password(password)
    if session.exec(select(AdminUser).where(AdminUser.username == username)).first() is not None:
        raise Conflict(f"console user {username!r} already exists")
    user = AdminUser(username=username, password_hash=_hasher.hash(password), role=checked)
    session.add(user)
    session.flush()
    append_event(session, actor=actor, origin=origin, action="user.create", target=f"user:{username}",
                 detail={"role": checked})
    return _public(user)


def list_users(session: Session) -> list[AdminUserPublic]:
    return [_public(u) for u in session.exec(select(AdminUser).order_by(col(AdminUser.username))).all()]


def set_role(session: Session, username: str, role: str, *, actor: str, origin: str) -> AdminUserPublic:
    user = _user(session, username)
    before, user.role = user.role, _check_role(role)
    session.add(user)
    append_event(session, actor=actor, origin=origin, action="user.role", target=f"user:{username}",
                 detail={"from": before, "to": user.role})
    return _public(user)


def set_password(session: Session, username: str, password: str, *, actor: str, origin: str) -> None:
    """A new password; every session of the user ends."""
    _check_password(password)
    user = _user(session, username)
    if user.oidc_issuer is not None:
        raise StoreError(f"{username} signs in through {user.oidc_issuer} and has no password here")
    user.password_hash = _hasher.hash(password)
    session.add(user)
    session.exec(delete(AdminSession).where(col(AdminSession.user_id) == user.id))
    append_event(session, actor=actor, origin=origin, action="user.password", target=f"user:{username}")


def disable_user(session: Session, username: str, *, actor: str, origin: str) -> AdminUserPublic:
    """The user can no longer log in; their sessions end."""
    user = _user(session, username)
    if user.disabled_at is None:
        user.disabled_at = utcnow()
        session.add(user)
        session.exec(delete(AdminSession).where(col(AdminSession.user_id) == user.id))
        append_event(session, actor=actor, origin=origin, action="user.disable", target=f"user:{username}")
    return _public(user)


def verify_password(session: Session, username: str, password: str) -> AdminUser | None:
    """The enabled user whose password this is, else None (in about the same time either way)."""
    user = session.exec(select(AdminUser).where(AdminUser.username == username)).first()
    try:
        _hasher.verify(user.password_hash if user is not None else _dummy_hash(), password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return None
    if user is None or user.disabled_at is not None:
        return None
    if _hasher.check_needs_rehash(user.password_hash):  # the parameters moved on (the library's, or the profile)
        user.password_hash = _hasher.hash(password)
        session.add(user)
    return user


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def open_session(session: Session, user: AdminUser, ttl: timedelta, client: str,
                 detail: dict[str, str] | None = None) -> str:
    """A new login session for ``user``; returns the token for the cookie (the only time it exists).
    ``detail`` goes into the audit entry (how they signed in, when not with a password)."""
    token = secrets.token_urlsafe(32)
    now = utcnow()
    session.exec(delete(AdminSession).where(col(AdminSession.expires_at) < now))  # sweep expired ones
    session.add(AdminSession(token_hash=_token_hash(token), user_id=user.id or 0, created_at=now,
                             expires_at=now + ttl, client=client[:128]))
    append_event(session, actor=f"console:{user.username}", origin=f"console {client}"[:128], action="user.login",
                 target=f"user:{user.username}", detail=detail)
    return token


class SignInRefused(StoreError):
    """An identity provider vouched for someone this console does not let in (the message says why)."""


def sso_user(session: Session, *, issuer: str, subject: str, username: str, role: str, client: str) -> AdminUser:
    """The console user an OpenID Connect provider signed in as (``issuer``, ``subject``), made on their first
    sign-in and given ``role`` (the provider's claim decides it at every sign-in). Refused
    (:class:`SignInRefused`) when the user was disabled here, or when a first sign-in's ``username`` is
    another user's (a local user is never taken over by a provider's account of the same name)."""
    origin = f"console {client}"[:128]
    checked = _check_role(role)
    user = session.exec(select(AdminUser).where(AdminUser.oidc_issuer == issuer,
                                                AdminUser.oidc_subject == subject)).first()
    if user is None:
        if not re.fullmatch(USERNAME_PATTERN, username):
            raise SignInRefused(f"the provider names this user {username[:80]!r}, which is not a console username "
                                "(1-64 letters, digits and . _ @ -)")
        if session.exec(select(AdminUser).where(AdminUser.username == username)).first() is not None:
            raise SignInRefused(f"a console user named {username!r} already exists and is not this provider's "
                                "account; an administrator can rename or remove it")
        user = AdminUser(username=username, password_hash="", role=checked, oidc_issuer=issuer,
                         oidc_subject=subject)
        session.add(user)
        session.flush()
        append_event(session, actor=f"console:{username}", origin=origin, action="user.create",
                     target=f"user:{username}", detail={"role": checked, "via": "oidc", "issuer": issuer})
        return user
    if user.disabled_at is not None:
        raise SignInRefused(f"the console user {user.username!r} is disabled")
    if user.role != checked:
        append_event(session, actor=f"console:{user.username}", origin=origin, action="user.role",
                     target=f"user:{user.username}", detail={"from": user.role, "to": checked, "via": "oidc"})
        user.role = checked
        session.add(user)
    return user


def session_user(session: Session, token: str, now: datetime | None = None) -> ConsoleUser | None:
    """Who the session cookie ``token`` belongs to, or None (unknown, expired, or user disabled)."""
    row = session.exec(
        select(AdminSession, AdminUser).join(AdminUser, col(AdminUser.id) == col(AdminSession.user_id))
        .where(AdminSession.token_hash == _token_hash(token))
    ).first()
    if row is None:
        return None
    login, user = row
    if login.expires_at <= (now or utcnow()) or user.disabled_at is not None:
        return None
    return ConsoleUser(id=user.id or 0, username=user.username, role=_check_role(user.role), session_id=login.id or 0)


def close_session(session: Session, token: str) -> None:
    """Log out: the session is gone on every replica."""
    session.exec(delete(AdminSession).where(col(AdminSession.token_hash) == _token_hash(token)))
