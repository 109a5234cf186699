"""Endpoints and pools as the gateway observes them: in-flight counts, the upstream client.

Owns: the shared HTTP connection pool to the engines and per-endpoint observations. Must not
touch: policy decisions (it reports state; ``decide`` chooses), the database.
"""
