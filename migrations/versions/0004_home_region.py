"""Home regions of tenants and API keys.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable columns: existing tenants and keys get no home region. SQLite adds them in place too.
    # No batch (table copy) on SQLite: recreating ``tenant`` would trip the foreign keys that
    # ``api_key`` and ``usage_daily`` hold on it.
    op.add_column("tenant", sa.Column("region", sa.String(length=63), nullable=True))
    op.add_column("api_key", sa.Column("region", sa.String(length=63), nullable=True))


def downgrade() -> None:
    # SQLite (3.35+) drops a column in place: no table copy, so the rows referencing these stay valid.
    op.drop_column("api_key", "region")
    op.drop_column("tenant", "region")
