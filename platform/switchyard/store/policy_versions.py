"""Policy versions: one row per accepted document, exactly one of them active."""

from __future__ import annotations

from sqlalchemy import func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from switchyard.store.models import PolicyVersion, PolicyVersionPublic


def active_version(session: Session) -> PolicyVersion | None:
    """The active version, if any was ever recorded."""
    return session.exec(select(PolicyVersion).where(col(PolicyVersion.active).is_(True))).first()


def record_version(session: Session, *, text: str, sha256: str, source: str, author: str,
                   message: str = "") -> tuple[PolicyVersionPublic, bool]:
    """Make ``text`` the active version; returns it and whether a new row was written.

    Identical content to the active version is not a new version. Two processes recording at
    once cannot both win: the version number is the primary key and only one row may be active,
    so the loser's transaction fails and it re-reads.
    """
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
        return PolicyVersionPublic.model_validate(row), True
    raise RuntimeError("could not record the policy version: the store kept changing under us")


def list_versions(session: Session, limit: int = 50) -> list[PolicyVersionPublic]:
    """The newest versions first."""
    rows = session.exec(select(PolicyVersion).order_by(col(PolicyVersion.number).desc()).limit(limit)).all()
    return [PolicyVersionPublic.model_validate(r) for r in rows]
