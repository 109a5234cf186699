"""Console users (argon2id password hashes, roles) and their login sessions.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "admin_user",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("username", sa.String(length=64), nullable=False),
        sa.Column("password_hash", sa.String(length=255), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('viewer', 'operator', 'admin')", name="ck_admin_user_role"),
    )
    op.create_index("ix_admin_user_username", "admin_user", ["username"], unique=True)
    op.create_table(
        "admin_session",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("admin_user.id"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("client", sa.String(length=128), nullable=False, server_default=""),
    )
    op.create_index("ix_admin_session_token_hash", "admin_session", ["token_hash"], unique=True)
    op.create_index("ix_admin_session_user_id", "admin_session", ["user_id"])


def downgrade() -> None:
    op.drop_index("ix_admin_session_user_id", table_name="admin_session")
    op.drop_index("ix_admin_session_token_hash", table_name="admin_session")
    op.drop_table("admin_session")
    op.drop_index("ix_admin_user_username", table_name="admin_user")
    op.drop_table("admin_user")
