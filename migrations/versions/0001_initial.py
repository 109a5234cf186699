"""Tenants, API keys (hashed) and policy versions.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_version",
        sa.Column("number", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("yaml_text", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("message", sa.String(length=1000), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["parent"], ["policy_version.number"]),
        sa.PrimaryKeyConstraint("number"),
    )
    op.create_index("ix_policy_version_sha256", "policy_version", ["sha256"])
    op.create_index(
        "uq_policy_version_one_active", "policy_version", ["active"], unique=True,
        sqlite_where=sa.text("active"), postgresql_where=sa.text("active"),
    )

    op.create_table(
        "tenant",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tenant_name", "tenant", ["name"], unique=True)

    op.create_table(
        "api_key",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=True),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_api_key_key_hash", "api_key", ["key_hash"], unique=True)
    op.create_index("ix_api_key_tenant_id", "api_key", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_api_key_tenant_id", table_name="api_key")
    op.drop_index("ix_api_key_key_hash", table_name="api_key")
    op.drop_table("api_key")
    op.drop_index("ix_tenant_name", table_name="tenant")
    op.drop_table("tenant")
    op.drop_index("uq_policy_version_one_active", table_name="policy_version")
    op.drop_index("ix_policy_version_sha256", table_name="policy_version")
    op.drop_table("policy_version")
