"""The OpenID Connect relying party's pure parts: PKCE, claims at a path, roles from a claim, what a discovery
document must say, the attempt's sealing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from switchyard.admin.oidc import Attempt, Provider, SignInError, challenge, claim_at, role_of
from switchyard.admin.sealed import seal, unseal
from switchyard.settings import Settings

ISSUER = "https://login.example.com/realms/acme"
DOC = {"issuer": ISSUER, "authorization_endpoint": f"{ISSUER}/auth", "token_endpoint": f"{ISSUER}/token",
       "jwks_uri": f"{ISSUER}/certs"}


def test_the_s256_challenge_is_rfc_7636s_example() -> None:
    assert challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk") == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"


def test_a_claim_at_a_dotted_path() -> None:
    claims = {"groups": ["a"], "realm_access": {"roles": ["gw-admins"]}}
    assert claim_at(claims, "realm_access.roles") == ["gw-admins"]
    assert claim_at(claims, "groups") == ["a"]
    assert claim_at(claims, "realm_access.missing") is None and claim_at(claims, "groups.x") is None


def test_the_highest_mapped_role_wins_else_the_default() -> None:
    table = {"staff": "viewer", "sre": "operator", "gw-admins": "admin"}
    assert role_of(("staff", "gw-admins", "sre"), table, None) == "admin"
    assert role_of(("staff",), table, None) == "viewer"
    assert role_of(("interns",), table, None) is None
    assert role_of((), table, "viewer") == "viewer"


def test_what_a_discovery_document_must_say() -> None:
    provider = Provider.from_document(DOC, ISSUER)
    assert provider.algorithms == {"RS256"} and provider.auth_methods == ("client_secret_basic",)
    with pytest.raises(SignInError, match="names the issuer"):
        Provider.from_document({**DOC, "issuer": "https://elsewhere"}, ISSUER)
    with pytest.raises(SignInError, match="token_endpoint"):
        Provider.from_document({k: v for k, v in DOC.items() if k != "token_endpoint"}, ISSUER)
    with pytest.raises(SignInError, match="S256"):
        Provider.from_document({**DOC, "code_challenge_methods_supported": ["plain"]}, ISSUER)
    with pytest.raises(SignInError, match="asymmetric"):
        Provider.from_document({**DOC, "id_token_signing_alg_values_supported": ["HS256", "none"]}, ISSUER)
    mixed = Provider.from_document({**DOC, "id_token_signing_alg_values_supported": ["HS256", "ES256"]}, ISSUER)
    assert mixed.algorithms == {"ES256"}  # a symmetric or unsigned token is never taken


def test_issuer_and_client_are_set_together() -> None:
    with pytest.raises(ValueError, match="set together"):
        Settings(console_oidc_issuer=ISSUER)
    with pytest.raises(ValueError, match="role"):
        Settings(console_oidc_issuer=ISSUER, console_oidc_client_id="c", console_oidc_roles={"x": "root"})


def test_a_sealed_attempt_opens_only_for_its_purpose_and_while_fresh(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, console_secret="s" * 32)
    attempt = Attempt(state="st", nonce="n", verifier="v" * 43, next="/admin/", redirect_uri="http://h/cb")
    sealed = seal(settings, "oidc-attempt", attempt.as_dict(), b"", 60)
    opened: dict[str, Any] | None = unseal(settings, "oidc-attempt", sealed, b"")
    assert opened is not None and Attempt.from_dict(opened) == attempt
    assert unseal(settings, "new-key-reveal", sealed, b"") is None  # another purpose's key
    assert unseal(settings, "oidc-attempt", sealed, b"bound elsewhere") is None
    assert unseal(settings, "oidc-attempt", sealed[:-4] + "AAAA", b"") is None  # tampered
    assert unseal(settings, "oidc-attempt", seal(settings, "oidc-attempt", {}, b"", -1), b"") is None  # stale
    other = Settings(data_dir=tmp_path, console_secret="t" * 32)
    assert unseal(other, "oidc-attempt", sealed, b"") is None  # another console's secret
