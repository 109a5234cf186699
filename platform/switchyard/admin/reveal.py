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

import base64
import binascii
import hashlib
import json
import os
import time
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from litestar import Request, Response
from litestar.datastructures import Cookie

from switchyard.admin.session import SESSION_COOKIE, console_secret, secure_request
from switchyard.settings import Settings

REVEAL_COOKIE = "switchyard_new_key"
#: How long the sealed secret waits for the redirect's GET (a browser follows at once; this only bounds
#: what a cookie left behind by a page never loaded could be worth).
REVEAL_TTL_S = 120
_NONCE = 12


def _aead(settings: Settings) -> AESGCM:
    return AESGCM(hashlib.sha256(b"switchyard/new-key-reveal\0" + console_secret(settings).encode()).digest())


def _bound_to(request: Request[Any, Any, Any], tenant: str) -> bytes:
    session = request.cookies.get(SESSION_COOKIE, "")
    return hashlib.sha256(session.encode()).digest() + tenant.encode()


def reveal_cookie(settings: Settings, request: Request[Any, Any, Any], tenant: str, path: str,
                  key: dict[str, Any]) -> Cookie:
    """The cookie that carries ``key`` (the new key's secret, id, prefix and name) to ``path``, the
    tenant page the POST redirects to."""
    nonce = os.urandom(_NONCE)
    body = json.dumps({**key, "expires": time.time() + REVEAL_TTL_S}).encode()
    sealed = nonce + _aead(settings).encrypt(nonce, body, _bound_to(request, tenant))
    return Cookie(key=REVEAL_COOKIE, value=base64.urlsafe_b64encode(sealed).decode(), path=path, httponly=True,
                  samesite="strict", secure=secure_request(settings, request), max_age=REVEAL_TTL_S)


def take_revealed(settings: Settings, request: Request[Any, Any, Any], tenant: str) -> dict[str, Any] | None:
    """The key sealed for this session and ``tenant``, if this request carries one still fresh."""
    value = request.cookies.get(REVEAL_COOKIE)
    if not value:
        return None
    try:
        sealed = base64.urlsafe_b64decode(value.encode())
        body = _aead(settings).decrypt(sealed[:_NONCE], sealed[_NONCE:], _bound_to(request, tenant))
        key: dict[str, Any] = json.loads(body)
    except (binascii.Error, ValueError, InvalidTag):
        return None
    return key if key.get("expires", 0) > time.time() else None


def forget_revealed(response: Response[Any], path: str) -> None:
    """Delete the reveal cookie in ``response`` (the page that showed it, or any page it reached)."""
    response.delete_cookie(REVEAL_COOKIE, path=path)
