"""A new key's secret, shown once after a redirect (post/redirect/get).

Creating a key is a POST; answering it with the page that shows the secret would make a reload of
that page post the form again and create another live key. So the POST answers with a redirect to the
tenant's page and hands the secret over in a short-lived cookie, sealed with AES-GCM under a key derived
from the console secret and bound to this console session and this tenant (another session, another
tenant's page or a copied cookie cannot open it). The page that opens it deletes it in its own
answer: the secret is shown once, a reload shows the page without it and creates nothing, and the server
keeps no copy of the secret anywhere (only its hash, in the key's row).
"""

from __future__ import annotations

import hashlib
from typing import Any

from litestar import Request, Response
from litestar.datastructures import Cookie

from switchyard.admin.sealed import seal, unseal
from switchyard.admin.session import SESSION_COOKIE, secure_request
from switchyard.settings import Settings

REVEAL_COOKIE = "switchyard_new_key"
#: How long the sealed secret waits for the redirect's GET (a browser follows at once; this only bounds
#: what a cookie left behind by a page never loaded could be worth).
REVEAL_TTL_S = 120
_PURPOSE = "new-key-reveal"


def _bound_to(request: Request[Any, Any, Any], tenant: str) -> bytes:
    session = request.cookies.get(SESSION_COOKIE, "")
    return hashlib.sha256(session.encode()).digest() + tenant.encode()


def reveal_cookie(settings: Settings, request: Request[Any, Any, Any], tenant: str, path: str,
                  key: dict[str, Any]) -> Cookie:
    """The cookie that carries ``key`` (the new key's secret, id, prefix and name) to ``path``, the
    tenant page the POST redirects to."""
    return Cookie(key=REVEAL_COOKIE, value=seal(settings, _PURPOSE, key, _bound_to(request, tenant), REVEAL_TTL_S),
                  path=path, httponly=True, samesite="strict", secure=secure_request(settings, request),
                  max_age=REVEAL_TTL_S)


def take_revealed(settings: Settings, request: Request[Any, Any, Any], tenant: str) -> dict[str, Any] | None:
    """The key sealed for this session and ``tenant``, if this request carries one still fresh."""
    return unseal(settings, _PURPOSE, request.cookies.get(REVEAL_COOKIE), _bound_to(request, tenant))


def forget_revealed(response: Response[Any], path: str) -> None:
    """Delete the reveal cookie in ``response`` (the page that showed it, or any page it reached)."""
    response.delete_cookie(REVEAL_COOKIE, path=path)
