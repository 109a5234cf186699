"""Tenants: who a key belongs to, which tier of the policy they are in, and their home region."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from switchyard.store.audit import append_event
from switchyard.store.errors import Conflict, NotFound
from switchyard.store.models import Tenant, TenantCreate, TenantPublic
from switchyard.store.regions import check_region


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
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a tenant named {data.name!r} already exists") from None
    return TenantPublic.model_validate(tenant)


def set_tier(session: Session, name: str, tier: str) -> TenantPublic:
    """Move a tenant to another tier."""
    tenant = get_tenant(session, name)
    tenant.tier = tier
    session.add(tenant)
    session.flush()
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
    return TenantPublic.model_validate(tenant)


def list_tenants(session: Session) -> list[TenantPublic]:
    """Every tenant, by name."""
    rows = session.exec(select(Tenant).order_by(Tenant.name)).all()
    return [TenantPublic.model_validate(t) for t in rows]
