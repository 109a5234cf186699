"""The audit log, append-only in the database itself.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A row once written is never changed or removed, whoever connects: the triggers refuse it.
_PG_FUNCTION = """
CREATE FUNCTION audit_event_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING MESSAGE = 'audit_event is append-only (' || TG_OP || ' refused)',
                          ERRCODE = 'restrict_violation';
END
$$
"""
_PG_TRIGGERS = (
    "CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON audit_event "
    "FOR EACH ROW EXECUTE FUNCTION audit_event_append_only()",
    "CREATE TRIGGER audit_event_no_truncate BEFORE TRUNCATE ON audit_event "
    "FOR EACH STATEMENT EXECUTE FUNCTION audit_event_append_only()",
)
_SQLITE_TRIGGERS = tuple(
    f"CREATE TRIGGER audit_event_no_{op_name.lower()} BEFORE {op_name} ON audit_event "
    "BEGIN SELECT RAISE(ABORT, 'audit_event is append-only'); END"
    for op_name in ("UPDATE", "DELETE")
)


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("origin", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(_PG_FUNCTION)
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    elif dialect == "sqlite":
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    # Dropping the table drops its triggers; PostgreSQL's trigger function outlives it.
    op.drop_table("audit_event")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION audit_event_append_only()")
