"""The admin console (htmx + Jinja2) and, later, its JSON admin API.

Owns: pages under ``/admin``. Must not touch: the request path, SQL (it calls ``store``),
decision logic (it calls ``decide``). This first console is read-only and shows no secrets.
"""
