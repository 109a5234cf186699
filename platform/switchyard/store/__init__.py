"""Durable state: SQLModel tables, the database engine, migrations, and the services over them.

Owns: tenants, API keys (hashed), policy versions and the append-only audit log; the engine/session
and Alembic upgrades.
Must not touch: HTTP. A version is published only through the policy gate
(``decide.policy_tests.compile_checked``: schema, references, policy tests), which store calls and
never reimplements.
"""
