"""The request log: finished requests (sampled) with their decision trace, kept for a while.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "request_log",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("replica", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("tier", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("resolved_model", sa.String(length=256), nullable=True),
        sa.Column("served_model", sa.String(length=256), nullable=True),
        sa.Column("pool", sa.String(length=128), nullable=True),
        sa.Column("region", sa.String(length=64), nullable=True),
        sa.Column("endpoint", sa.String(length=512), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("error_code", sa.String(length=128), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("priority", sa.String(length=64), nullable=True),
        sa.Column("queue_ms", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("cache", sa.String(length=16), nullable=False),
        sa.Column("cache_rule", sa.String(length=256), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
    )
    op.create_index("ix_request_log_at", "request_log", ["at"])
    op.create_index("ix_request_log_request_id", "request_log", ["request_id"])
    op.create_index("ix_request_log_tenant_id", "request_log", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_request_log_tenant_id", table_name="request_log")
    op.drop_index("ix_request_log_request_id", table_name="request_log")
    op.drop_index("ix_request_log_at", table_name="request_log")
    op.drop_table("request_log")
