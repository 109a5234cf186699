"""Tenants: who a key belongs to and which tier of the policy they are in."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from switchyard.store.errors import Conflict, NotFound
from switchyard.store.models import Tenant, TenantCreate, TenantPublic


def get_tenant(session: Session, name: str) -> Tenant:
    """The tenant called ``name``."""
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def create_tenant(session: Session, data: TenantCreate) -> TenantPublic:
    """Create a tenant; its name must be new."""
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


def list_tenants(session: Session) -> list[TenantPublic]:
    """Every tenant, by name."""
    rows = session.exec(select(Tenant).order_by(Tenant.name)).all()
    return [TenantPublic.model_validate(t) for t in rows]
