"""Console sign-in through the organisation's identity provider: OpenID Connect, authorization code flow
with PKCE (RFC 7636, S256), as a relying party.

What this module does, in the order of a sign-in:

1. :meth:`OidcClient.provider` reads the provider's discovery document
   (``<issuer>/.well-known/openid-configuration``, whose ``issuer`` must equal the configured one) and keeps
   it for an hour.
2. :meth:`OidcClient.start` makes a sign-in attempt: a random ``state`` (ties the callback to this
   browser), ``nonce`` (ties the ID token to this attempt) and PKCE code verifier, and the provider's
   authorization URL carrying the verifier's S256 challenge.
3. :meth:`OidcClient.finish` trades the code for tokens at the token endpoint (with the verifier; client
   authentication by ``client_secret_basic`` or ``client_secret_post`` as the provider supports, none for
   a public client), checks the ID token (signature by the provider's JWKS — asymmetric algorithms only,
   the keys read again once when a token names an unknown ``kid``, the key rotated — issuer, audience,
   ``azp``, expiry, issue time, nonce) and reads the user's name and console role: the role claim from the
   ID token, else from the userinfo endpoint (whose ``sub`` must be the token's), mapped through the
   configured table (the highest role wins; no mapped value: the default role, or refused).

Nothing here touches the database or the web framework: :mod:`switchyard.admin.login` drives it.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from switchyard.settings import Settings
from switchyard.store.admin_users import RANK, ROLES

if TYPE_CHECKING:  # (imported where a sign-in uses them: a console without OpenID Connect never loads them)
    import httpx
    import jwt

#: Signature algorithms an ID token may use: asymmetric ones (a symmetric one would make the client secret
#: a signing key, and a public client has none).
ASYMMETRIC = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"})
#: With no role table configured, a claim value that is a role's name gives that role (a claim such as
#: ``switchyard_role: operator`` defined at the provider).
IDENTITY_ROLES: dict[str, str] = {role: role for role in ROLES}
DISCOVERY_TTL_S = 3600.0
#: Clock skew allowed between the provider and this host when checking exp, iat and nbf.
LEEWAY_S = 60
TIMEOUT_S = 10.0


class SignInError(Exception):
    """A sign-in that cannot go on; the message says why in words an operator can act on. ``status``: 502 when
    the provider could not be used (unreachable, a bad answer), 401 when what it sent does not hold."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class NoRole(SignInError):
    """The provider signed someone in whom the role table gives no console role (403)."""

    def __init__(self, message: str, username: str) -> None:
        super().__init__(message, 403)
        self.username = username


@dataclass(frozen=True, slots=True)
class Provider:
    """What the discovery document says (the parts a sign-in uses)."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None
    algorithms: frozenset[str]
    auth_methods: tuple[str, ...]

    @classmethod
    def from_document(cls, doc: Mapping[str, Any], issuer: str) -> Provider:
        if doc.get("issuer") != issuer:
            raise SignInError(f"the provider's discovery document names the issuer {doc.get('issuer')!r}, "
                              f"not {issuer!r} (console_oidc_issuer must be exactly the provider's issuer)")
        missing = [k for k in ("authorization_endpoint", "token_endpoint", "jwks_uri") if not doc.get(k)]
        if missing:
            raise SignInError(f"the provider's discovery document has no {', '.join(missing)}")
        methods = doc.get("code_challenge_methods_supported")
        if methods is not None and "S256" not in methods:
            raise SignInError("the provider does not support PKCE with S256 (code_challenge_methods_supported "
                              f"is {methods!r})")
        algorithms = frozenset(doc.get("id_token_signing_alg_values_supported") or ["RS256"]) & ASYMMETRIC
        if not algorithms:
            raise SignInError("the provider signs ID tokens with no asymmetric algorithm "
                              f"({doc.get('id_token_signing_alg_values_supported')!r})")
        return cls(issuer=issuer, authorization_endpoint=doc["authorization_endpoint"],
                   token_endpoint=doc["token_endpoint"], jwks_uri=doc["jwks_uri"],
                   userinfo_endpoint=doc.get("userinfo_endpoint"), algorithms=algorithms,
                   auth_methods=tuple(doc.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One sign-in in flight: kept sealed in the browser between the redirect and the callback."""

    state: str
    nonce: str
    verifier: str
    next: str
    redirect_uri: str

    def as_dict(self) -> dict[str, str]:
        return {"state": self.state, "nonce": self.nonce, "verifier": self.verifier, "next": self.next,
                "redirect_uri": self.redirect_uri}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Attempt:
        return cls(**{k: str(value[k]) for k in ("state", "nonce", "verifier", "next", "redirect_uri")})


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the provider signed in: the console user they are and the role their claim gives."""

    issuer: str
    subject: str
    username: str
    role: str
    claimed: tuple[str, ...]  # the role claim's values, for the audit log and the refusal message


def challenge(verifier: str) -> str:
    """PKCE's S256 code challenge of ``verifier`` (RFC 7636 §4.2)."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).rstrip(b"=").decode()


def claim_at(claims: Mapping[str, Any], path: str) -> Any:
    """The claim at a dotted ``path`` (``realm_access.roles``), None when absent."""
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def role_of(values: tuple[str, ...], table: Mapping[str, str], default: str | None) -> str | None:
    """The highest console role ``table`` gives any of the claim's ``values``; else ``default``."""
    roles = [table[v] for v in values if v in table]
    return max(roles, key=RANK.__getitem__) if roles else default


def _form_encoded(text: str) -> str:
    return urlencode({"": text})[1:]


def _values(claim: Any) -> tuple[str, ...]:
    if isinstance(claim, str):
        return (claim,)
    if isinstance(claim, list | tuple):
        return tuple(str(v) for v in claim if isinstance(v, str | int))
    return ()


class OidcClient:
    """The console's relying party for one provider (one per app; discovery and keys cached in it)."""

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if settings.console_oidc_issuer is None or settings.console_oidc_client_id is None:
            raise ValueError("an OpenID Connect client needs console_oidc_issuer and console_oidc_client_id")
        self.settings = settings
        self.issuer = settings.console_oidc_issuer
        self.client_id = settings.console_oidc_client_id
        self._transport = transport
        self._provider: tuple[float, Provider] | None = None
        self._keys: jwt.PyJWKSet | None = None

    async def _json(self, method: str, url: str, what: str, **kwargs: Any) -> Any:
        import httpx

        try:  # a client per call: sign-ins are rare, and nothing is left open between them
            async with httpx.AsyncClient(timeout=TIMEOUT_S, transport=self._transport) as http:
                answer = await http.request(method, url, **kwargs)
        except httpx.HTTPError as e:
            raise SignInError(f"the identity provider did not answer its {what} ({url}): {e or type(e).__name__}",
                              502) from e
        try:
            body = answer.json()
        except ValueError:
            body = None
        if answer.status_code >= 400:
            said = ""
            if isinstance(body, dict) and body.get("error"):
                said = f": {body['error']}" + (f" ({body['error_description']})" if body.get("error_description")
                                               else "")
            raise SignInError(f"the identity provider's {what} answered {answer.status_code}{said}",
                              401 if answer.status_code < 500 else 502)
        if not isinstance(body, dict):
            raise SignInError(f"the identity provider's {what} did not answer with a JSON object", 502)
        return body

    async def provider(self) -> Provider:
        """The discovery document's endpoints (read at most once an hour)."""
        now = time.monotonic()
        if self._provider is not None and now - self._provider[0] < DISCOVERY_TTL_S:
            return self._provider[1]
        doc = await self._json("GET", self.issuer.rstrip("/") + "/.well-known/openid-configuration",
                               "discovery document")
        try:
            found = Provider.from_document(doc, self.issuer)
        except SignInError as e:  # the provider is not usable as configured: not the user's doing
            raise SignInError(str(e), 502) from None
        self._provider = (now, found)
        return found

    async def start(self, next_page: str, redirect_uri: str) -> tuple[Attempt, str]:
        """A new sign-in attempt and the provider URL to send the browser to."""
        provider = await self.provider()
        attempt = Attempt(state=secrets.token_urlsafe(24), nonce=secrets.token_urlsafe(24),
                          verifier=secrets.token_urlsafe(48), next=next_page, redirect_uri=redirect_uri)
        scopes = self.settings.console_oidc_scopes.split()
        query = {"response_type": "code", "client_id": self.client_id, "redirect_uri": redirect_uri,
                 "scope": " ".join(["openid", *(s for s in scopes if s != "openid")]), "state": attempt.state,
                 "nonce": attempt.nonce, "code_challenge": challenge(attempt.verifier),
                 "code_challenge_method": "S256"}
        separator = "&" if "?" in provider.authorization_endpoint else "?"
        return attempt, provider.authorization_endpoint + separator + urlencode(query)

    async def finish(self, attempt: Attempt, code: str) -> Identity:
        """Trade ``code`` for tokens, check the ID token and say who signed in (:class:`SignInError` if not)."""
        provider = await self.provider()
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": attempt.redirect_uri,
                "code_verifier": attempt.verifier, "client_id": self.client_id}
        auth: tuple[str, str] | None = None  # (httpx sends a (user, password) pair as HTTP Basic)
        secret = self.settings.console_oidc_client_secret
        if secret is not None:
            if "client_secret_basic" in provider.auth_methods:  # RFC 6749 §2.3.1: each part form-encoded
                auth = (_form_encoded(self.client_id), _form_encoded(secret.get_secret_value()))
            elif "client_secret_post" in provider.auth_methods:
                form["client_secret"] = secret.get_secret_value()
            else:
                raise SignInError("the provider takes neither client_secret_basic nor client_secret_post "
                                  f"({', '.join(provider.auth_methods)}): unset the client secret for a public "
                                  "client", 502)
        tokens = await self._json("POST", provider.token_endpoint, "token endpoint", data=form, auth=auth,
                                  headers={"Accept": "application/json"})
        id_token = tokens.get("id_token")
        if not isinstance(id_token, str):
            raise SignInError("the token endpoint's answer has no ID token (is 'openid' among the client's scopes?)")
        claims = await self._verify(provider, id_token, attempt.nonce)
        role_claim = self.settings.console_oidc_role_claim
        values = _values(claim_at(claims, role_claim))
        if claim_at(claims, role_claim) is None and provider.userinfo_endpoint and tokens.get("access_token"):
            info = await self._json("GET", provider.userinfo_endpoint, "userinfo endpoint",
                                    headers={"Authorization": f"Bearer {tokens['access_token']}",
                                             "Accept": "application/json"})
            if info.get("sub") != claims["sub"]:
                raise SignInError("the userinfo endpoint answered for another subject than the ID token's")
            claims = {**info, **claims}
            values = _values(claim_at(info, role_claim))
        username = next((str(claims[c]) for c in (self.settings.console_oidc_username_claim, "email", "sub")
                         if isinstance(claims.get(c), str) and claims[c]), str(claims["sub"]))
        table: Mapping[str, str] = self.settings.console_oidc_roles or IDENTITY_ROLES
        role = role_of(values, table, self.settings.console_oidc_default_role)
        if role is None:
            held = ", ".join(values) if values else "nothing"
            raise NoRole(f"{username} has no console role: the claim {role_claim!r} holds {held}, and none of it "
                         "is mapped to a role (console_oidc_roles) nor is there a default role", username)
        return Identity(issuer=provider.issuer, subject=str(claims["sub"]), username=username, role=role,
                        claimed=values)

    async def _key(self, provider: Provider, kid: str | None) -> jwt.PyJWK:
        import jwt

        for fresh in (False, True):
            if self._keys is None or fresh:
                try:
                    self._keys = jwt.PyJWKSet.from_dict(await self._json("GET", provider.jwks_uri, "key set"))
                except jwt.PyJWKSetError as e:
                    raise SignInError(f"the provider's key set cannot be read: {e}") from e
            usable = [k for k in self._keys.keys if kid is None or k.key_id == kid]
            if kid is None and len(usable) > 1:
                raise SignInError("the ID token names no key (kid) and the provider has several")
            if usable:
                return usable[0]
        raise SignInError(f"the ID token was signed with a key the provider does not publish (kid {kid!r})")

    async def _verify(self, provider: Provider, id_token: str, nonce: str) -> dict[str, Any]:
        import jwt

        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError as e:
            raise SignInError(f"the ID token is not a JWT: {e}") from e
        algorithm = header.get("alg")
        if algorithm not in provider.algorithms:
            raise SignInError(f"the ID token is signed with {algorithm!r}, not one of "
                              f"{', '.join(sorted(provider.algorithms))}")
        key = await self._key(provider, header.get("kid"))
        try:
            claims: dict[str, Any] = jwt.decode(
                id_token, key=key, algorithms=[algorithm], audience=self.client_id, issuer=provider.issuer,
                leeway=LEEWAY_S, options={"require": ["iss", "sub", "aud", "exp", "iat"]})
        except jwt.PyJWTError as e:
            raise SignInError(f"the ID token is not valid: {e}") from e
        audience = claims["aud"]
        if isinstance(audience, list) and len(audience) > 1 and claims.get("azp") != self.client_id:
            raise SignInError("the ID token is for several audiences and was not issued to this console (azp)")
        if not secrets.compare_digest(str(claims.get("nonce", "")), nonce):
            raise SignInError("the ID token's nonce is not this sign-in's (a replayed or mixed-up token)")
        return claims
