"""The request log keeps the output budget a request asked for (what a replay of the log sends).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("max_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("max_tokens")
