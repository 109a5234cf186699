"""Policy canaries: a candidate version serving a slice of traffic, its figures per gateway process, and the
request log's version and canary role.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_canary",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("version", sa.Integer(), sa.ForeignKey("policy_version.number"), nullable=False),
        sa.Column("base", sa.Integer(), sa.ForeignKey("policy_version.number"), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("rollout", sa.Text(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    op.create_index("ix_policy_canary_version", "policy_canary", ["version"])
    op.create_index("uq_policy_canary_one_running", "policy_canary", ["status"], unique=True,
                    sqlite_where=sa.text("status = 'running'"), postgresql_where=sa.text("status = 'running'"))
    op.create_table(
        "canary_figures",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("canary_id", sa.Integer(), sa.ForeignKey("policy_canary.id"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replica", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.String(length=64), nullable=False),
        sa.Column("figures", sa.Text(), nullable=False),
    )
    op.create_index("ix_canary_figures_canary_id", "canary_figures", ["canary_id"])
    op.create_index("ix_canary_figures_at", "canary_figures", ["at"])
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("policy_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("canary", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("canary")
        batch.drop_column("policy_version")
    op.drop_index("ix_canary_figures_at", table_name="canary_figures")
    op.drop_index("ix_canary_figures_canary_id", table_name="canary_figures")
    op.drop_table("canary_figures")
    op.drop_index("uq_policy_canary_one_running", table_name="policy_canary")
    op.drop_index("ix_policy_canary_version", table_name="policy_canary")
    op.drop_table("policy_canary")
