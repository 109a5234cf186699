"""Console users who sign in through an OpenID Connect provider: the issuer and subject that name them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("admin_user") as batch:
        batch.add_column(sa.Column("oidc_issuer", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("oidc_subject", sa.String(length=255), nullable=True))
        batch.create_unique_constraint("uq_admin_user_oidc", ["oidc_issuer", "oidc_subject"])


def downgrade() -> None:
    with op.batch_alter_table("admin_user") as batch:
        batch.drop_constraint("uq_admin_user_oidc", type_="unique")
        batch.drop_column("oidc_subject")
        batch.drop_column("oidc_issuer")
