"""The admin console (htmx + Jinja2 pages under ``/admin``) and its JSON admin API (``/admin/api``).

Owns: logins, sessions, roles and CSRF for the console; its pages (overview, policy with edits,
publish, history and the replay before publish, tenants and keys, usage, requests, dry-run, cache,
batches, audit) and the admin API's routes, each given only the pieces of the gateway it uses
(``dependencies``), never the gateway's runtime. Must not touch: the request path, SQL (every query is a
``store`` function), decision logic (the dry-run and policy tests run ``decide``'s procedure); the errors,
OpenAPI pieces and header names it shares with the gateway are ``switchyard.api``'s.
"""
