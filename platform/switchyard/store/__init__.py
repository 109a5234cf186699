"""Durable state: SQLModel tables, the database engine, migrations, and the services over them.

Owns: tenants and API keys (hashed) with their limit overrides and home regions, policy versions,
the append-only audit log, the daily usage ledger, the request log, console users and sessions, the
Batch API's files, batches and their lines' lease queue, the token-bucket limit store (``limits``:
in process or Redis), the response cache's backends (``cache``: in process or Redis); the
engine/session and Alembic upgrades.
Must not touch: HTTP. A version is published only through the policy gate
(``decide.policy_tests.compile_checked``: schema, references, policy tests), which store calls and
never reimplements.
"""
