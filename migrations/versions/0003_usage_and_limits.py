"""The daily usage ledger, and limit overrides on tenants and keys.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("spend", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"]),
        sa.ForeignKeyConstraint(["key_id"], ["api_key.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "key_id", "model", "day", name="uq_usage_daily_tenant_key_model_day"),
    )
    op.create_index("ix_usage_daily_day", "usage_daily", ["day"])
    # Nullable columns: existing tenants and keys get no override. SQLite adds them in place too.
    op.add_column("tenant", sa.Column("limits", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("api_key", sa.Column("limits", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    # SQLite (3.35+) drops a column in place: no table copy, so the keys referencing tenants stay valid.
    op.drop_column("api_key", "limits")
    op.drop_column("tenant", "limits")
    op.drop_index("ix_usage_daily_day", table_name="usage_daily")
    op.drop_table("usage_daily")
