"""The OpenAI Files and Batch API: files, batch jobs and one row per input line.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUSES = "'validating', 'in_progress', 'finalizing', 'completed', 'failed', 'expired', 'cancelling', 'cancelled'"
_STATES = "'pending', 'running', 'succeeded', 'failed'"


def upgrade() -> None:
    op.create_table(
        "batch_file",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenant.id"), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_batch_file_tenant_created", "batch_file", ["tenant_id", "created_at"])
    op.create_table(
        "batch",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenant.id"), nullable=False),
        sa.Column("key_id", sa.Integer(), sa.ForeignKey("api_key.id"), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("user_metadata", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("total_count", sa.Integer(), nullable=False),
        sa.Column("completed_count", sa.Integer(), nullable=False),
        sa.Column("failed_count", sa.Integer(), nullable=False),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("errors", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalizing_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name="ck_batch_status"),
    )
    op.create_index("ix_batch_tenant_created", "batch", ["tenant_id", "created_at"])
    op.create_index("ix_batch_status", "batch", ["status"])
    op.create_table(
        "batch_request",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("batch_id", sa.String(length=64), sa.ForeignKey("batch.id"), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("response", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"state IN ({_STATES})", name="ck_batch_request_state"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_request_batch_custom_id"),
        sa.UniqueConstraint("batch_id", "line_no", name="uq_batch_request_batch_line"),
    )
    op.create_index("ix_batch_request_claim", "batch_request", ["state", "next_attempt_at"])
    op.create_index("ix_batch_request_lease", "batch_request", ["state", "lease_until"])
    op.create_index("ix_batch_request_batch_state", "batch_request", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_batch_request_batch_state", table_name="batch_request")
    op.drop_index("ix_batch_request_lease", table_name="batch_request")
    op.drop_index("ix_batch_request_claim", table_name="batch_request")
    op.drop_table("batch_request")
    op.drop_index("ix_batch_status", table_name="batch")
    op.drop_index("ix_batch_tenant_created", table_name="batch")
    op.drop_table("batch")
    op.drop_index("ix_batch_file_tenant_created", table_name="batch_file")
    op.drop_table("batch_file")
