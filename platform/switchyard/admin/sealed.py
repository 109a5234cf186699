"""Short-lived values the console hands to the browser and reads back: JSON sealed with AES-GCM.

The key is derived from the console secret and a purpose (so a value sealed for one use opens for no
other), and each value is bound to what it belongs to (associated data: a console session, a tenant, a
sign-in attempt), so a copied or tampered cookie opens nowhere else. The browser can neither read nor
change what is inside; the server keeps no copy of it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

from switchyard.admin.session import console_secret
from switchyard.settings import Settings

if TYPE_CHECKING:  # (imported when a value is first sealed or opened: most processes never do)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_NONCE = 12


def _aead(settings: Settings, purpose: str) -> AESGCM:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hashlib.sha256(f"switchyard/{purpose}\0".encode() + console_secret(settings).encode()).digest())


def seal(settings: Settings, purpose: str, value: dict[str, Any], bound: bytes, ttl_s: float) -> str:
    """``value`` sealed for ``purpose`` and bound to ``bound``, good for ``ttl_s`` seconds (cookie-safe text)."""
    nonce = os.urandom(_NONCE)
    body = json.dumps({**value, "expires": time.time() + ttl_s}).encode()
    return base64.urlsafe_b64encode(nonce + _aead(settings, purpose).encrypt(nonce, body, bound)).decode()


def unseal(settings: Settings, purpose: str, sealed: str | None, bound: bytes) -> dict[str, Any] | None:
    """What :func:`seal` sealed, if ``sealed`` opens for this purpose and binding and is still fresh."""
    if not sealed:
        return None
    from cryptography.exceptions import InvalidTag

    try:
        raw = base64.urlsafe_b64decode(sealed.encode())
        value: dict[str, Any] = json.loads(_aead(settings, purpose).decrypt(raw[:_NONCE], raw[_NONCE:], bound))
    except (binascii.Error, ValueError, InvalidTag):
        return None
    return value if isinstance(value, dict) and value.get("expires", 0) > time.time() else None
