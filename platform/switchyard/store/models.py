"""SQLModel tables. Alembic migrations (``migrations/``) are the only way their schema changes."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlmodel import Field, SQLModel

from switchyard.store.regions import REGION_MAX_LENGTH, REGION_PATTERN


def utcnow() -> datetime:
    """Now, timezone-aware, in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on SQLite as on PostgreSQL."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _ts(nullable: bool = False) -> Any:
    return Field(default_factory=utcnow if not nullable else None,
                 sa_column=Column(UTCDateTime(), nullable=nullable))


def _region() -> Any:
    # A home region (``store.regions``): where routing prefers to serve; NULL for none.
    return Field(default=None, max_length=REGION_MAX_LENGTH, schema_extra={"pattern": REGION_PATTERN})


def _limits() -> Any:
    # Overrides of the policy's limits, shaped as a tier's ``limits`` (policy.tiers.Limits);
    # NULL (not JSON null) when there is none.
    return Field(default=None, sa_column=Column(JSON(none_as_null=True), nullable=True))


# --- tenants -------------------------------------------------------------------------------

class TenantBase(SQLModel):
    name: str = Field(max_length=64, unique=True, index=True)
    tier: str = Field(max_length=64)
    region: str | None = _region()  # the home region of the tenant's keys that have none of their own


class TenantCreate(TenantBase):
    pass


class TenantPublic(TenantBase):
    id: int
    created_at: datetime


class Tenant(TenantBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    created_at: datetime = _ts()
    limits: dict[str, Any] | None = _limits()  # replaces the tier's limits field by field


# --- API keys ------------------------------------------------------------------------------

class ApiKeyBase(SQLModel):
    name: str | None = Field(default=None, max_length=128)
    region: str | None = _region()  # the key's own home region; else its tenant's applies


class ApiKeyCreate(ApiKeyBase):
    tenant: str


class ApiKeyPublic(ApiKeyBase):
    id: int
    tenant: str
    tier: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    #: The region routing prefers for the key's requests: its own ``region``, else its tenant's.
    home_region: str | None


class ApiKey(ApiKeyBase, table=True):
    __tablename__ = "api_key"

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    # What the owner sees to tell keys apart; never enough to use the key.
    prefix: str = Field(max_length=16)
    # sha256 of the whole key. Keys carry 256 bits of randomness, so a fast hash is safe here
    # (unlike passwords) and lets the gateway look a key up by its hash.
    key_hash: str = Field(max_length=64, unique=True, index=True)
    created_at: datetime = _ts()
    revoked_at: datetime | None = _ts(nullable=True)
    limits: dict[str, Any] | None = _limits()  # limits of this key, on top of its tenant's


# --- policy versions -----------------------------------------------------------------------

class PolicyVersionBase(SQLModel):
    author: str = Field(max_length=128)
    source: str = Field(max_length=16)  # file | console | api | rollback
    message: str = Field(default="", max_length=1000)


class PolicyVersionPublic(PolicyVersionBase):
    number: int
    sha256: str
    parent: int | None
    active: bool
    created_at: datetime


class PolicyVersion(PolicyVersionBase, table=True):
    __tablename__ = "policy_version"
    __table_args__ = (
        # Exactly one active version: a unique index over the rows where active is true.
        Index("uq_policy_version_one_active", "active", unique=True,
              sqlite_where=text("active"), postgresql_where=text("active")),
    )

    number: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    yaml_text: str = Field(sa_column=Column(Text, nullable=False))
    sha256: str = Field(max_length=64, index=True)
    parent: int | None = Field(default=None, foreign_key="policy_version.number")
    active: bool = Field(default=False)
    created_at: datetime = _ts()


# --- audit log -----------------------------------------------------------------------------

class AuditEventBase(SQLModel):
    actor: str = Field(max_length=128)  # who: "cli:alice", "api", "file:/etc/switchyard/policies.yaml"
    origin: str = Field(max_length=128)  # through what: "cli", "api 10.0.0.7", "file", "console"
    action: str = Field(max_length=64)  # "policy.publish", "policy.rollback", "policy.import"
    target: str = Field(max_length=128)  # "policy:v7"


class AuditEventPublic(AuditEventBase):
    id: int
    at: datetime
    detail: dict[str, Any]


class AuditEvent(AuditEventBase, table=True):
    """One entry of the audit log. Append-only: the database refuses UPDATE and DELETE on it."""

    __tablename__ = "audit_event"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = _ts()
    detail: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


# --- usage ledger --------------------------------------------------------------------------

class UsageCounts(SQLModel):
    requests: int = Field(default=0, sa_type=BigInteger)
    prompt_tokens: int = Field(default=0, sa_type=BigInteger)
    completion_tokens: int = Field(default=0, sa_type=BigInteger)
    cached_tokens: int = Field(default=0, sa_type=BigInteger)  # of prompt_tokens, served from the prefix cache
    spend: float = Field(default=0.0)  # in the policy's currency


class UsageDailyPublic(UsageCounts):
    tenant: str
    key_id: int
    model: str
    day: date


class UsageReport(SQLModel):
    rows: list[UsageDailyPublic]
    totals: UsageCounts


class UsageDaily(UsageCounts, table=True):
    """What one key of one tenant used of one model on one UTC day. Rows only ever grow."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        UniqueConstraint("tenant_id", "key_id", "model", "day", name="uq_usage_daily_tenant_key_model_day"),
        Index("ix_usage_daily_day", "day"),
    )

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    key_id: int = Field(foreign_key="api_key.id")
    model: str = Field(max_length=128)  # the concrete model that served the requests
    day: date  # UTC


# --- console users and their sessions ------------------------------------------------------

class AdminUserPublic(SQLModel):
    id: int
    username: str
    role: str
    created_at: datetime
    disabled_at: datetime | None
    oidc_issuer: str | None = None


class AdminUser(SQLModel, table=True):
    """Someone who may log in to the console. The password is stored as an argon2id hash only."""

    __tablename__ = "admin_user"
    __table_args__ = (UniqueConstraint("oidc_issuer", "oidc_subject", name="uq_admin_user_oidc"),)

    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=64, unique=True, index=True)
    password_hash: str = Field(max_length=255)
    role: str = Field(max_length=16)  # viewer | operator | admin
    created_at: datetime = _ts()
    disabled_at: datetime | None = _ts(nullable=True)
    #: A user who signs in through an OpenID Connect provider: who the provider says they are (issuer and
    #: subject, unique together). Such a user has no password (an empty hash verifies nothing).
    oidc_issuer: str | None = Field(default=None, max_length=255)
    oidc_subject: str | None = Field(default=None, max_length=255)


class AdminSession(SQLModel, table=True):
    """A console login. The cookie holds a random token; only its sha256 is stored (a leaked table
    holds no usable session)."""

    __tablename__ = "admin_session"

    id: int | None = Field(default=None, primary_key=True)
    token_hash: str = Field(max_length=64, unique=True, index=True)
    user_id: int = Field(foreign_key="admin_user.id", index=True)
    created_at: datetime = _ts()
    expires_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))
    client: str = Field(default="", max_length=128)  # the address it logged in from


# --- batch ---------------------------------------------------------------------------------
# The OpenAI Files and Batch API (``store.files``, ``store.batches``, ``store.batch_queue``,
# ``store.batch_finalize``): files kept in the database so that every replica can read them, batch
# jobs, and one row per input line that the batch workers claim.

#: A batch's statuses (OpenAI's); ``validating`` and ``finalizing`` last only inside a transaction here.
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled")
#: A batch line's states: waiting (or waiting for a retry), leased to a worker, done either way.
REQUEST_STATES = ("pending", "running", "succeeded", "failed")


def _sql_in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class BatchFile(SQLModel, table=True):
    """An uploaded file (purpose ``batch``) or a batch's output or error file (``batch_output``)."""

    __tablename__ = "batch_file"
    __table_args__ = (Index("ix_batch_file_tenant_created", "tenant_id", "created_at"),)

    id: str = Field(primary_key=True, max_length=64)  # "file-…"
    tenant_id: int = Field(foreign_key="tenant.id")
    purpose: str = Field(max_length=32)
    filename: str = Field(max_length=255)
    size: int = Field(sa_type=BigInteger)  # bytes of content
    content: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = _ts()


class Batch(SQLModel, table=True):
    """A batch job of one tenant: its input file's lines (``batch_request``) run against ``endpoint``."""

    __tablename__ = "batch"
    __table_args__ = (
        CheckConstraint(_sql_in("status", BATCH_STATUSES), name="ck_batch_status"),
        Index("ix_batch_tenant_created", "tenant_id", "created_at"),
        Index("ix_batch_status", "status"),
    )

    id: str = Field(primary_key=True, max_length=64)  # "batch_…"
    tenant_id: int = Field(foreign_key="tenant.id")
    key_id: int = Field(foreign_key="api_key.id")  # the key that created it: its lines run as that key
    endpoint: str = Field(max_length=64)
    input_file_id: str = Field(max_length=64)  # no foreign key: the input file may be deleted meanwhile
    completion_window: str = Field(max_length=16)
    status: str = Field(max_length=16)
    user_metadata: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON(none_as_null=True),
                                                                                nullable=True))
    total_count: int = Field(default=0)
    completed_count: int = Field(default=0)
    failed_count: int = Field(default=0)
    output_file_id: str | None = Field(default=None, max_length=64)
    error_file_id: str | None = Field(default=None, max_length=64)
    # OpenAI's ``errors`` object ({"object": "list", "data": [...]}) of a batch whose input was refused.
    errors: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON(none_as_null=True), nullable=True))
    created_at: datetime = _ts()
    in_progress_at: datetime | None = _ts(nullable=True)
    expires_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))
    finalizing_at: datetime | None = _ts(nullable=True)
    completed_at: datetime | None = _ts(nullable=True)
    failed_at: datetime | None = _ts(nullable=True)
    expired_at: datetime | None = _ts(nullable=True)
    cancelling_at: datetime | None = _ts(nullable=True)
    cancelled_at: datetime | None = _ts(nullable=True)


class BatchRequest(SQLModel, table=True):
    """One line of a batch's input and, once it ran, its result; claimed by workers under a lease."""

    __tablename__ = "batch_request"
    __table_args__ = (
        CheckConstraint(_sql_in("state", REQUEST_STATES), name="ck_batch_request_state"),
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_request_batch_custom_id"),
        UniqueConstraint("batch_id", "line_no", name="uq_batch_request_batch_line"),
        # Claiming: due pending lines (oldest first), and running lines whose lease ran out.
        Index("ix_batch_request_claim", "state", "next_attempt_at"),
        Index("ix_batch_request_lease", "state", "lease_until"),
        # Finalizing: does a batch still have lines to run?
        Index("ix_batch_request_batch_state", "batch_id", "state"),
    )

    # 64-bit on PostgreSQL (fifty thousand rows a batch add up); SQLite's INTEGER key is 64-bit already.
    id: int | None = Field(default=None, sa_column=Column(BigInteger().with_variant(Integer(), "sqlite"),
                                                          primary_key=True))
    batch_id: str = Field(foreign_key="batch.id", max_length=64)
    line_no: int  # 1-based line of the input file
    custom_id: str = Field(max_length=512)
    body: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    state: str = Field(default="pending", max_length=16)
    attempts: int = Field(default=0)
    lease_owner: str | None = Field(default=None, max_length=128)
    lease_until: datetime | None = _ts(nullable=True)
    next_attempt_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))
    status_code: int | None = Field(default=None)
    request_id: str | None = Field(default=None, max_length=128)
    response: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON(none_as_null=True), nullable=True))
    error: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON(none_as_null=True), nullable=True))
    finished_at: datetime | None = _ts(nullable=True)


# --- request log ---------------------------------------------------------------------------
# Finished requests as the gateways saw them (``store.request_log``): sampled, kept for a while,
# shown by the console across replicas. Never a key, a prompt or an answer.


class RequestLogEntry(SQLModel, table=True):
    """One finished request: who, what was asked and served where, how it ended, its decision trace."""

    __tablename__ = "request_log"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False, index=True))
    request_id: str = Field(max_length=128, index=True)
    #: The gateway process that served it (host:pid).
    replica: str = Field(max_length=128)
    kind: str = Field(max_length=16)
    tenant: str | None = Field(default=None, max_length=128)
    tenant_id: int | None = Field(default=None, index=True)
    key_id: int | None = None
    tier: str | None = Field(default=None, max_length=64)
    model: str | None = Field(default=None, max_length=256)
    resolved_model: str | None = Field(default=None, max_length=256)
    served_model: str | None = Field(default=None, max_length=256)
    pool: str | None = Field(default=None, max_length=128)
    region: str | None = Field(default=None, max_length=64)
    endpoint: str | None = Field(default=None, max_length=512)
    status: int
    outcome: str = Field(max_length=16)
    error_code: str | None = Field(default=None, max_length=128)
    stream: bool = False
    priority: str | None = Field(default=None, max_length=64)
    queue_ms: float | None = None
    attempts: int = 0
    ttft_ms: float | None = None
    duration_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    #: The output budget the client asked for (what a replay of the log sends for a refused request).
    max_tokens: int | None = None
    #: 64 bits of SHA-256 of the request as the response cache keys it: which requests repeated.
    digest: str | None = Field(default=None, max_length=16)
    #: It asked for a reproducible answer (temperature 0 or a seed).
    deterministic: bool | None = None
    cache: str = Field(default="none", max_length=16)
    cache_rule: str | None = Field(default=None, max_length=256)
    #: The policy version that decided it (a canary's candidate for its slice).
    policy_version: int | None = None
    #: Its part in a policy canary: ``canary`` (decided by the candidate), ``control`` (the rest of the
    #: canary's scope) or ``shadow`` (decided by the active version, and by the candidate alongside).
    canary: str | None = Field(default=None, max_length=16)
    #: JSON: ``{"moved_on": [...], "trace": [...]}`` (and ``shadow``: what the candidate would have decided
    #: otherwise, ``{field: [active, candidate]}``).
    detail: str = Field(sa_column=Column(Text(), nullable=False))


# --- policy canaries -----------------------------------------------------------------------
# A candidate version serving a slice of traffic next to the active one (``store.canary``).

#: A canary's states: running, then promoted, rolled back (a guardrail breached) or aborted (by hand, or
#: superseded by a publish).
CANARY_STATES = ("running", "promoted", "rolled_back", "aborted")


class PolicyCanary(SQLModel, table=True):
    """One canary rollout of a policy version; at most one runs at a time."""

    __tablename__ = "policy_canary"
    __table_args__ = (
        Index("uq_policy_canary_one_running", "status", unique=True,
              sqlite_where=text("status = 'running'"), postgresql_where=text("status = 'running'")),
    )

    id: int | None = Field(default=None, primary_key=True)
    #: The candidate version (stored, not active while the canary runs).
    version: int = Field(foreign_key="policy_version.number", index=True)
    #: The version active when it started (what the slice is compared with).
    base: int | None = Field(default=None, foreign_key="policy_version.number")
    status: str = Field(default="running", max_length=16)
    #: The rollout as declared (``policy.rollout.Rollout``), JSON.
    rollout: str = Field(sa_column=Column(Text(), nullable=False))
    #: The index of the current step in the rollout's stages, and its share of traffic.
    step: int = 0
    percent: float
    started_at: datetime = _ts()
    step_started_at: datetime = _ts()
    ended_at: datetime | None = _ts(nullable=True)
    author: str = Field(max_length=128)
    #: Why it ended (the breached guardrail, who aborted it).
    reason: str = Field(default="", sa_column=Column(Text(), nullable=False))


class CanaryFigures(SQLModel, table=True):
    """What one gateway process counted for a canary since its previous flush, per side and class."""

    __tablename__ = "canary_figures"

    id: int | None = Field(default=None, primary_key=True)
    canary_id: int = Field(foreign_key="policy_canary.id", index=True)
    at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False, index=True))
    replica: str = Field(max_length=128)
    #: ``canary``, ``control`` or ``shadow``; the priority class (``*``: all classes).
    role: str = Field(max_length=16)
    priority: str = Field(max_length=64)
    #: JSON: ``decide.canary.Tally.as_json`` (shadow: ``{"requests": n, "diffs": {field: n}}``).
    figures: str = Field(sa_column=Column(Text(), nullable=False))
