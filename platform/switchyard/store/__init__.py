"""Durable state: SQLModel tables, the database engine, migrations, and the services over them.

Owns: tenants, API keys (hashed), policy versions; the engine/session and Alembic upgrades.
Must not touch: HTTP, the policy schema's meaning (it stores policy text, it does not parse it).
"""
