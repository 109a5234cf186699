"""The OpenAI-compatible gateway: it carries out the decisions ``decide`` makes.

Owns: the HTTP API, authentication, the upstream calls and streaming, metrics, the app's
lifespan. Must not touch: decision logic (it calls ``decide``), SQL (it calls ``store``), the
policy's schema (it reads compiled snapshots).
"""
