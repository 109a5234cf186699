"""Tenants: who a key belongs to, which tier of the policy they are in, and their home region.

A change that alters what a key lookup answers (tier, region, deletion) is announced to every
gateway process's key cache in the same transaction (``store/key_changes.py``).

**Deletion** removes the tenant and everything it owns: keys, files, batches, usage ledger rows,
request-log rows. It is refused while one of its batches may still run lines. Ids are never given
again: PostgreSQL's sequences never reuse one, and on SQLite (which would give the largest id again
once its row is gone) a new tenant or key gets an id above every deleted one (each deletion's audit
entry records its ids), so nothing keyed by a tenant's or key's id (response-cache scopes, limit
counters) can reach a later tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from switchyard.store.audit import append_event
from switchyard.store.errors import Conflict, NotFound
from switchyard.store.key_changes import announce
from switchyard.store.models import (
    ApiKey,
    AuditEvent,
    Batch,
    BatchFile,
    BatchRequest,
    RequestLogEntry,
    Tenant,
    TenantCreate,
    TenantPublic,
    UsageDaily,
)
from switchyard.store.regions import check_region

#: The audit action of a deletion (its detail holds the ids that must not be given again).
DELETE_ACTION = "tenant.delete"
#: Batch statuses whose lines may still run: a tenant with such a batch is not deleted.
_LIVE_BATCH = ("validating", "in_progress", "finalizing", "cancelling")


def get_tenant(session: Session, name: str) -> Tenant:
    """The tenant called ``name``."""
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def create_tenant(session: Session, data: TenantCreate) -> TenantPublic:
    """Create a tenant; its name must be new.

    Raises:
        Conflict: A tenant of that name exists.
        StoreError: ``data.region`` is not a valid region name.
    """
    check_region(data.region)
    tenant = Tenant.model_validate(data)
    floor = deleted_id_floor(session, "id")
    if floor is not None and floor >= (session.exec(select(func.max(Tenant.id))).one() or 0):
        tenant.id = floor + 1  # SQLite would give a deleted tenant's id again
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a tenant named {data.name!r} already exists") from None
    return TenantPublic.model_validate(tenant)


def set_tier(session: Session, name: str, tier: str) -> TenantPublic:
    """Move a tenant to another tier (announced to the gateways' key caches)."""
    tenant = get_tenant(session, name)
    tenant.tier = tier
    session.add(tenant)
    session.flush()
    announce(session, f"tenant:{tenant.id}")
    return TenantPublic.model_validate(tenant)


def set_tenant_region(session: Session, name: str, region: str | None, *, actor: str, origin: str) -> TenantPublic:
    """Set (or, with ``None``, clear) a tenant's home region, and audit it in the same transaction.

    The region applies to each of the tenant's keys that has no region of its own.

    Args:
        session: The session whose transaction carries the change.
        name: The tenant.
        region: A region name, or ``None`` for none.
        actor: Who changes it (for the audit log).
        origin: Through what (``cli``, ``api 10.0.0.7``).

    Raises:
        StoreError: ``region`` is not a valid region name; nothing was written.
        NotFound: No such tenant.
    """
    check_region(region)
    tenant = get_tenant(session, name)
    previous, tenant.region = tenant.region, region
    session.add(tenant)
    session.flush()
    append_event(session, actor=actor, origin=origin, action="tenant.region", target=f"tenant:{name}",
                 detail={"region": region, "previous": previous})
    announce(session, f"tenant:{tenant.id}")
    return TenantPublic.model_validate(tenant)


def list_tenants(session: Session) -> list[TenantPublic]:
    """Every tenant, by name."""
    rows = session.exec(select(Tenant).order_by(Tenant.name)).all()
    return [TenantPublic.model_validate(t) for t in rows]


def limit_overrides(session: Session) -> dict[str, Mapping[str, Any] | None]:
    """Every tenant by name, with its override of its tier's limits (``None``: none set)."""
    return dict(session.exec(select(Tenant.name, Tenant.limits)).all())


def delete_tenant(session: Session, name: str, *, actor: str, origin: str) -> dict[str, Any]:
    """Delete a tenant and everything it owns, audited and announced in the same transaction.

    Its keys stop working at the next request on every gateway process once the transaction
    commits (and, through :func:`switchyard.store.key_changes.changing_keys`, every process confirmed).

    Args:
        session: The session whose transaction carries the deletion.
        name: The tenant.
        actor: Who deletes it (for the audit log).
        origin: Through what (``cli``, ``api 10.0.0.7``, ``console``).

    Returns:
        The tenant's id and tier and how many rows of each kind went.

    Raises:
        NotFound: No such tenant.
        Conflict: One of its batches may still run lines (cancel it, or let it finish, first).
    """
    tenant = get_tenant(session, name)
    tenant_id = tenant.id or 0
    live = session.exec(select(func.count()).select_from(Batch).where(
        Batch.tenant_id == tenant_id, col(Batch.status).in_(_LIVE_BATCH))).one()
    if live:
        raise Conflict(f"tenant {name!r} has {live} batch(es) that may still run lines; cancel them (or let "
                       "them finish) before deleting it")
    key_ids = [k for k in session.exec(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id)).all() if k is not None]
    batches = select(Batch.id).where(Batch.tenant_id == tenant_id)
    gone: dict[str, Any] = {"id": tenant_id, "tier": tenant.tier, "max_key_id": max(key_ids, default=None)}
    for label, statement in (
        ("batch_lines", delete(BatchRequest).where(col(BatchRequest.batch_id).in_(batches))),
        ("batches", delete(Batch).where(col(Batch.tenant_id) == tenant_id)),
        ("files", delete(BatchFile).where(col(BatchFile.tenant_id) == tenant_id)),
        ("usage_rows", delete(UsageDaily).where(col(UsageDaily.tenant_id) == tenant_id)),
        ("request_log_rows", delete(RequestLogEntry).where(col(RequestLogEntry.tenant_id) == tenant_id)),
        ("keys", delete(ApiKey).where(col(ApiKey.tenant_id) == tenant_id)),
        ("tenant", delete(Tenant).where(col(Tenant.id) == tenant_id)),
    ):
        gone[label] = session.execute(statement).rowcount  # type: ignore[attr-defined]
    append_event(session, actor=actor, origin=origin, action=DELETE_ACTION, target=f"tenant:{name}", detail=gone)
    announce(session, f"tenant:{tenant_id}")
    return gone


def deleted_id_floor(session: Session, field: str) -> int | None:
    """On SQLite, the largest tenant id (``field="id"``) or key id (``"max_key_id"``) a deleted tenant
    had: new rows get larger ones (SQLite would give the largest id again once its row is gone).
    None on PostgreSQL (a sequence never gives an id twice) and when nothing was deleted."""
    if session.get_bind().dialect.name != "sqlite":
        return None
    details = session.exec(select(AuditEvent.detail).where(AuditEvent.action == DELETE_ACTION)).all()
    ids = [int(d[field]) for d in details if isinstance(d, dict) and isinstance(d.get(field), int)]
    return max(ids, default=None)
