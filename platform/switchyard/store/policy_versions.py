"""Policy versions: one row per accepted document, exactly one of them active.

A new version is written together with its audit entry and, on PostgreSQL, a notification on
:data:`CHANNEL` carrying its number: all three in one transaction, so other processes hear of a
version exactly when it commits, and never of one that was rolled back.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, update
from sqlalchemy import text as sql_text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from switchyard.decide.policy_tests import compile_checked
from switchyard.store.audit import append_event
from switchyard.store.errors import NotFound, StoreError
from switchyard.store.models import PolicyVersion, PolicyVersionPublic

#: The PostgreSQL LISTEN/NOTIFY channel a new version is announced on (payload: its number).
CHANNEL = "switchyard_policy"

#: Where a version can come from: the policy file, the console, the admin API, the command line,
#: or a rollback to an earlier version.
SOURCES = ("file", "console", "api", "cli", "rollback")

_ACTIONS = {"file": "policy.import", "rollback": "policy.rollback"}
#: The longest author name a version (and an audit entry) can carry.
MAX_AUTHOR = 128
_MAX_MESSAGE = 1000


def active_version(session: Session) -> PolicyVersion | None:
    """The active version, if any was ever recorded."""
    return session.exec(select(PolicyVersion).where(col(PolicyVersion.active).is_(True))).first()


def get_version(session: Session, number: int) -> PolicyVersion:
    """Version ``number``, text included.

    Raises:
        NotFound: there is no such version.
    """
    row = session.get(PolicyVersion, number)
    if row is None:
        raise NotFound(f"no policy version {number}")
    return row


def record_version(session: Session, *, text: str, sha256: str, source: str, author: str,
                   message: str = "", origin: str | None = None,
                   rollback_to: int | None = None) -> tuple[PolicyVersionPublic, bool]:
    """Make ``text`` the active version; returns it and whether a new row was written.

    The caller has validated ``text``. Identical content to the active version is not a new
    version (and is not audited). Two processes recording at once cannot both win: the version
    number is the primary key and only one row may be active, so the loser's transaction fails
    and it re-reads. A new version is audited (``origin`` defaults to ``source``) and announced
    on :data:`CHANNEL` in the caller's transaction; a running canary is aborted in it
    (:func:`switchyard.store.canary.supersede`).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown policy version source {source!r}")
    for _attempt in range(5):
        current = active_version(session)
        if current is not None and current.sha256 == sha256:
            return PolicyVersionPublic.model_validate(current), False
        number = (session.exec(select(func.max(PolicyVersion.number))).one() or 0) + 1
        try:
            with session.begin_nested():
                session.execute(update(PolicyVersion).where(col(PolicyVersion.active).is_(True))
                                .values(active=False))
                row = PolicyVersion(number=number, yaml_text=text, sha256=sha256, source=source,
                                    author=author, message=message, active=True,
                                    parent=current.number if current else None)
                session.add(row)
                session.flush()
        except IntegrityError:
            session.expire_all()
            continue
        _announce(session, row, origin or source, rollback_to)
        from switchyard.store.canary import supersede  # (it builds on this module)

        supersede(session, row.number, author, origin or source)
        return PolicyVersionPublic.model_validate(row), True
    raise RuntimeError("could not record the policy version: the store kept changing under us")


def _announce(session: Session, row: PolicyVersion, origin: str, rollback_to: int | None) -> None:
    detail: dict[str, Any] = {"from": row.parent, "to": row.number, "sha256": row.sha256,
                              "source": row.source, "message": row.message}
    if rollback_to is not None:
        detail["rollback_to"] = rollback_to
    append_event(session, actor=row.author, origin=origin, action=_ACTIONS.get(row.source, "policy.publish"),
                 target=f"policy:v{row.number}", detail=detail)
    if session.get_bind().dialect.name == "postgresql":
        # Delivered to listeners when (and only if) this transaction commits.
        session.execute(sql_text("SELECT pg_notify(:channel, :payload)"),
                        {"channel": CHANNEL, "payload": str(row.number)})


def publish(session: Session, text: str, *, source: str, author: str, message: str = "",
            origin: str | None = None, document: str | None = None) -> tuple[PolicyVersionPublic, bool]:
    """Validate ``text`` through the policy gate and make it the active version.

    Args:
        session: The transaction the version, its audit entry and its notification share.
        text: The policy document's YAML text, stored as it is (comments included).
        source: One of :data:`SOURCES` (``rollback`` is :func:`rollback`'s).
        author: Who publishes (``cli:alice``).
        message: Why.
        origin: Through what, for the audit log (``cli``, ``api 10.0.0.7``); default ``source``.
        document: How validation errors name the document (a file path); default ``<source>``.

    Returns:
        The active version and whether it is new (identical content is not a new version).

    Raises:
        PolicyError: the document is invalid or one of its tests fails; nothing was written.
        StoreError: the author or message is too long; nothing was written.
    """
    return _publish(session, text, source=source, author=author, message=message, origin=origin,
                    document=document or f"<{source}>", rollback_to=None)


def rollback(session: Session, number: int, *, author: str, message: str | None = None,
             origin: str | None = None) -> tuple[PolicyVersionPublic, bool]:
    """Publish version ``number``'s text again, as a new version with source ``rollback``.

    Returns:
        The active version and whether it is new: rolling back to the content that is already
        active writes nothing and returns that version with ``False``.

    Raises:
        NotFound: there is no version ``number``.
        PolicyError: the old document no longer passes the policy gate; nothing was written.
    """
    old = get_version(session, number)
    return _publish(session, old.yaml_text, source="rollback", author=author,
                    message=message or f"rollback to v{number}", origin=origin,
                    document=f"policy version {number}", rollback_to=number)


def _publish(session: Session, text: str, *, source: str, author: str, message: str, origin: str | None,
             document: str, rollback_to: int | None) -> tuple[PolicyVersionPublic, bool]:
    if not author or len(author) > MAX_AUTHOR:
        raise StoreError(f"the author must be 1 to {MAX_AUTHOR} characters")
    if len(message) > _MAX_MESSAGE:
        raise StoreError(f"the message must be at most {_MAX_MESSAGE} characters")
    snapshot = compile_checked(text, document)
    return record_version(session, text=snapshot.text, sha256=snapshot.sha256, source=source, author=author,
                          message=message, origin=origin, rollback_to=rollback_to)


def list_versions(session: Session, limit: int = 50) -> list[PolicyVersionPublic]:
    """The newest versions first."""
    rows = session.exec(select(PolicyVersion).order_by(col(PolicyVersion.number).desc()).limit(limit)).all()
    return [PolicyVersionPublic.model_validate(r) for r in rows]
