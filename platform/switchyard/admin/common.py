"""What the admin API's handlers share: database calls off the event loop, the request body, where a
change came from, and the admin token guard."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import Guard
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin.dependencies import KeyChanger
from switchyard.api.errors import BadRequest, Forbidden, NotFound, Unauthorized
from switchyard.settings import Settings
from switchyard.store import errors as store_errors
from switchyard.store.db import in_transaction

#: The environment variable of the admin token setting (``Settings.admin_token``), for messages.
ADMIN_TOKEN_ENV = "SWITCHYARD_ADMIN_TOKEN"  # noqa: S105  (the name of a variable, not a secret)

T = TypeVar("T")
B = TypeVar("B", bound=msgspec.Struct)


def admin_token_guard(settings: Settings) -> Guard:
    """The guard of the admin API: a request goes through only with ``Authorization: Bearer <token>`` matching
    ``settings``' admin token."""
    token = settings.admin_token

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler) -> None:
        expected = token.get_secret_value() if token is not None else ""
        if not expected:
            raise Forbidden(f"the admin API is disabled: set {ADMIN_TOKEN_ENV}", code="admin_api_disabled")
        scheme, _, given = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise Unauthorized(f"the admin API needs the admin token: Authorization: Bearer <{ADMIN_TOKEN_ENV}>",
                               code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"})

    return guard


class PageError(Exception):
    """Input or a state a console page refuses: shown in a role="alert" box, answered with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


async def in_db(db: Engine, work: Callable[[Session], T], *, keys: KeyChanger | None = None) -> T:
    """Run ``work`` in one transaction on a worker thread (the database calls block), the store's refusals as
    API errors; ``keys``: ``work`` changes what key lookups answer (a revocation, a tenant's deletion or tier),
    so it runs through ``keys`` and returns only once every gateway process dropped it from its key cache."""
    try:
        if keys is not None:
            return (await keys(work))[0]
        return await in_transaction(db, work)
    except store_errors.NotFound as exc:
        raise NotFound(str(exc)) from None
    except store_errors.StoreError as exc:
        raise BadRequest(str(exc)) from None


def origin_of(request: Request[Any, Any, Any]) -> str:
    return f"api {request.client.host}" if request.client is not None else "api"


async def json_body(request: Request[Any, Any, Any], kind: type[B]) -> B:
    """The JSON body as ``kind``, or a 400 that says what is wrong with it."""
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.DecodeError as exc:  # malformed JSON, or the wrong fields (ValidationError)
        raise BadRequest(f"invalid request body: {exc}") from None
