"""The audit log: who changed what, when and through which door.

Append-only: this module offers appending and listing, nothing else, and the database refuses
UPDATE and DELETE on the table (triggers made by the migration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlmodel import Session, col, select

from switchyard.store.models import AuditEvent, AuditEventPublic


def append_event(session: Session, *, actor: str, origin: str, action: str, target: str,
                 detail: Mapping[str, Any] | None = None) -> AuditEventPublic:
    """Write one entry in the caller's transaction (it is kept only if that commits).

    Args:
        session: The session whose transaction also carries the change being audited.
        actor: Who acted (``cli:alice``, ``api``, ``file:/path``).
        origin: Through what (``cli``, ``api 10.0.0.7``, ``file``, ``console``).
        action: What was done (``policy.publish``).
        target: What it was done to (``policy:v7``).
        detail: JSON-able facts about the change (``{"from": 6, "to": 7, "sha256": ...}``).
    """
    event = AuditEvent(actor=actor, origin=origin, action=action, target=target,
                       detail=dict(detail or {}))
    session.add(event)
    session.flush()
    return AuditEventPublic.model_validate(event)


def list_events(session: Session, limit: int = 50, action: str | None = None, *, actor: str | None = None,
                before_id: int | None = None) -> list[AuditEventPublic]:
    """The newest entries first, optionally only those whose action starts with ``action``, whose
    actor starts with ``actor``, and (paging back) whose id is below ``before_id``."""
    query = select(AuditEvent)
    if action is not None:
        query = query.where(col(AuditEvent.action).startswith(action))
    if actor is not None:
        query = query.where(col(AuditEvent.actor).startswith(actor, autoescape=True))
    if before_id is not None:
        query = query.where(col(AuditEvent.id) < before_id)
    rows = session.exec(query.order_by(col(AuditEvent.id).desc()).limit(limit)).all()
    return [AuditEventPublic.model_validate(r) for r in rows]
