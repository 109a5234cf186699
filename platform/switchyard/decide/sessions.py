"""Session affinity: which endpoint served a conversation last, so the next turn can go there too.

The session is named by a request header (``x-session-id`` unless the profile says otherwise) or,
where the profile allows, the body's ``user`` field; it is kept per tenant and model. Which endpoint
served it last is the executor's memory (:class:`switchyard.state.sessions.SessionIndex` in the
gateway), read and written by the session-affinity scorer (:mod:`switchyard.decide.plugins`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Session ids longer than this are cut: the key is memory the client controls.
MAX_SESSION_CHARS = 256


def session_key(header: str, use_user: bool, headers: Mapping[str, str], body: Mapping[str, Any], tenant: str,
                model: str) -> str | None:
    """The request's session: the id in ``header`` (lower-case), else the body's ``user`` when ``use_user``
    (None: no id was given), kept apart per tenant and model."""
    sid = headers.get(header)
    if not sid and use_user:
        user = body.get("user")
        sid = user if isinstance(user, str) else None
    if not sid:
        return None
    return f"{tenant}\x00{model}\x00{sid[:MAX_SESSION_CHARS]}"
