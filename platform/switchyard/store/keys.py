"""API keys: created once (the only time the secret is seen), stored as a hash, revocable; each may have a
home region of its own (else its tenant's applies).

The secret is never stored, logged or compared: only its SHA-256 is (see :func:`identify`). A
revocation or a region change is announced to every gateway process's key cache in the same
transaction (``store/key_changes.py``): with :func:`switchyard.store.key_changes.changing_keys` the
key stops working at the next request on every process.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, func, select

from switchyard.policy.tiers import Limits
from switchyard.store.audit import append_event
from switchyard.store.errors import Conflict, NotFound
from switchyard.store.key_changes import announce
from switchyard.store.models import ApiKey, ApiKeyPublic, Tenant, utcnow
from switchyard.store.regions import check_region
from switchyard.store.tenants import deleted_id_floor, get_tenant

KEY_PREFIX = "sk-sy-"
_DISPLAY_CHARS = 6  # shown to tell keys apart: 36 of the 256 random bits


def generate_key() -> str:
    """A new API key: a fixed prefix and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of a key (hex sha256)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Who a valid key speaks for."""

    key_id: int
    tenant_id: int
    tenant: str
    tier: str
    #: The tenant's and the key's limit overrides (``None``: none set).
    tenant_limits: Limits | None = None
    key_limits: Limits | None = None
    #: The home region routing prefers: the key's own, else its tenant's (``None``: neither has one).
    region: str | None = None


def home_region(key: ApiKey, tenant: Tenant) -> str | None:
    """The region routing prefers for ``key``'s requests: its own, else its tenant's."""
    return key.region if key.region is not None else tenant.region


def _public(key: ApiKey, tenant: Tenant) -> ApiKeyPublic:
    return ApiKeyPublic(id=key.id or 0, name=key.name, region=key.region, tenant=tenant.name, tier=tenant.tier,
                        prefix=key.prefix, created_at=key.created_at, revoked_at=key.revoked_at,
                        home_region=home_region(key, tenant))


def _key_and_tenant(session: Session, key_id: int) -> tuple[ApiKey, Tenant]:
    row = session.exec(
        select(ApiKey, Tenant).join(Tenant, col(ApiKey.tenant_id) == col(Tenant.id)).where(ApiKey.id == key_id)
    ).first()
    if row is None:
        raise NotFound(f"no key with id {key_id}")
    return row


def create_key(session: Session, tenant_name: str, name: str | None = None,
               region: str | None = None) -> tuple[str, ApiKeyPublic]:
    """Create a key for an existing tenant; returns the secret (show it once) and the record.

    Args:
        session: The session whose transaction carries the new key.
        tenant_name: The tenant the key speaks for.
        name: A label for the key.
        region: The key's own home region (``None``: its tenant's applies).

    Raises:
        NotFound: No such tenant.
        StoreError: ``region`` is not a valid region name.
    """
    check_region(region)
    tenant = get_tenant(session, tenant_name)
    secret = generate_key()
    key = ApiKey(tenant_id=tenant.id or 0, name=name, region=region,
                 prefix=secret[: len(KEY_PREFIX) + _DISPLAY_CHARS], key_hash=hash_key(secret))
    floor = deleted_id_floor(session, "max_key_id")
    if floor is not None and floor >= (session.exec(select(func.max(ApiKey.id))).one() or 0):
        key.id = floor + 1  # SQLite would give a deleted key's id again
    session.add(key)
    session.flush()
    return secret, _public(key, tenant)


def list_keys(session: Session, tenant_name: str | None = None) -> list[ApiKeyPublic]:
    """Keys (never their secrets), oldest first, optionally of one tenant."""
    query = select(ApiKey, Tenant).join(Tenant, col(ApiKey.tenant_id) == col(Tenant.id))
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    return [_public(k, t) for k, t in session.exec(query.order_by(col(ApiKey.id))).all()]


def key_limit_overrides(session: Session, tenant_id: int) -> dict[int, Mapping[str, Any] | None]:
    """Each key of tenant ``tenant_id`` by id, with its own limits override (``None``: none set)."""
    rows = session.exec(select(ApiKey.id, ApiKey.limits).where(ApiKey.tenant_id == tenant_id)).all()
    return {key_id: limits for key_id, limits in rows if key_id is not None}


def tenant_of_key(session: Session, key_id: int) -> str | None:
    """The name of the tenant key ``key_id`` belongs to, or ``None`` when there is no such key."""
    name: str | None = session.exec(select(Tenant.name).join(ApiKey, col(ApiKey.tenant_id) == col(Tenant.id))
                                    .where(ApiKey.id == key_id)).first()
    return name


def revoke_key(session: Session, key_id: int) -> ApiKeyPublic:
    """Revoke a key for good (announced to the gateways' key caches in the same transaction)."""
    key, tenant = _key_and_tenant(session, key_id)
    if key.revoked_at is not None:
        raise Conflict(f"key {key_id} was already revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    key.revoked_at = utcnow()
    session.add(key)
    session.flush()
    announce(session, f"key:{key_id}")
    return _public(key, tenant)


def set_key_region(session: Session, key_id: int, region: str | None, *, actor: str, origin: str) -> ApiKeyPublic:
    """Set (or, with ``None``, clear: its tenant's then applies) a key's own home region, audited.

    Args:
        session: The session whose transaction carries the change and its audit event.
        key_id: The key.
        region: A region name, or ``None`` for none of its own.
        actor: Who changes it (for the audit log).
        origin: Through what (``cli``, ``api 10.0.0.7``).

    Raises:
        StoreError: ``region`` is not a valid region name; nothing was written.
        NotFound: No such key.
    """
    check_region(region)
    key, tenant = _key_and_tenant(session, key_id)
    previous, key.region = key.region, region
    session.add(key)
    session.flush()
    append_event(session, actor=actor, origin=origin, action="key.region", target=f"key:{key_id}",
                 detail={"region": region, "previous": previous})
    announce(session, f"key:{key_id}")
    return _public(key, tenant)


def identify(session: Session, key_hash: str) -> KeyIdentity | None:
    """The identity behind a presented key's hash, or ``None`` when it is unknown or revoked.

    Why this is constant-time with respect to the secret: the lookup is by hash on a unique index,
    so no comparison ever runs over the secret itself, and the secret never reaches the database.
    The index's comparisons do stop at the first byte where two *digests* differ, so their timing
    could at best tell an attacker how many leading bytes the digest of a guess shares with a stored
    digest. That is worthless: keys are 256 random bits, and steering a guess towards a digest
    prefix is a preimage search on SHA-256, so no measurement brings a guess closer to a key
    (unlike comparing the secret byte by byte, which leaks it a byte at a time).
    """
    return _identity(session, ApiKey.key_hash == key_hash)


def identity_of(session: Session, key_id: int) -> KeyIdentity | None:
    """The identity of the key with this id (a batch job's lines run as the key that made it), or
    ``None`` when it is unknown or revoked."""
    return _identity(session, col(ApiKey.id) == key_id)


def _identity(session: Session, where: Any) -> KeyIdentity | None:
    row = session.exec(
        select(ApiKey, Tenant)
        .join(Tenant, col(ApiKey.tenant_id) == col(Tenant.id))
        .where(where)
    ).first()
    if row is None:
        return None
    key, tenant = row
    if key.revoked_at is not None:
        return None
    return KeyIdentity(key_id=key.id or 0, tenant_id=tenant.id or 0, tenant=tenant.name, tier=tenant.tier,
                       tenant_limits=_limits(tenant.limits), key_limits=_limits(key.limits),
                       region=home_region(key, tenant))


def _limits(stored: dict[str, Any] | None) -> Limits | None:
    """A stored override as the policy's Limits (only the fields it sets count as set)."""
    return Limits.model_validate(stored) if stored is not None else None
