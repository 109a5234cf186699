"""A small OpenID Connect provider for the console's sign-in tests, run as its own process on loopback.

``python -m tests.oidc_provider --port P --client-id ID [--client-secret S] [--auth-method M]`` serves
discovery, an authorization endpoint (a form asking who signs in and their groups, as a provider's login
page would), a token endpoint that checks the client, the code and its PKCE verifier (S256 only), a JWKS,
and userinfo. ID tokens are RS256-signed JWTs with a key made at start.

``POST /control`` (JSON) makes it misbehave the way a broken or hostile provider would: ``{"nonce":
"wrong"}``, ``{"aud": "someone-else"}``, ``{"exp": -3600}`` (seconds from now), ``{"sign": "foreign"}``
(a key it does not publish, under a published kid), ``{"auth_method": "client_secret_post"}`` (or
``"none"``: a public client), ``{"groups_in": "userinfo"}`` (the role claim only in userinfo),
``{"rotate": true}`` (a new signing key; the JWKS publishes only it), ``{"issuer": "..."}`` (the
discovery document names another issuer); ``{}`` resets. ``GET /requests`` lists the token requests it got.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import html
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import jwt
import uvicorn
from cryptography.hazmat.primitives.asymmetric import rsa
from litestar import Litestar, Request, Response, get, post
from litestar.enums import RequestEncodingType
from litestar.params import Body
from litestar.response import Redirect

Form = Annotated[dict[str, str], Body(media_type=RequestEncodingType.URL_ENCODED)]


class Provider:
    def __init__(self, base: str, client_id: str, client_secret: str | None, auth_method: str) -> None:
        self.base = base
        self.client_id = client_id
        self.client_secret = client_secret
        self.auth_method = auth_method
        self.faults: dict[str, Any] = {}
        self.codes: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.keys: list[tuple[str, rsa.RSAPrivateKey]] = []
        self.rotate()

    def rotate(self) -> None:
        self.keys = [(f"k{len(self.keys) + 1}-{secrets.token_hex(3)}",
                      rsa.generate_private_key(public_exponent=65537, key_size=2048))]

    def jwks(self) -> dict[str, Any]:
        found = []
        for kid, key in self.keys:
            jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
            found.append({**jwk, "kid": kid, "use": "sig", "alg": "RS256"})
        return {"keys": found}

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.faults.get("issuer", self.base), "authorization_endpoint": f"{self.base}/authorize",
                "token_endpoint": f"{self.base}/token", "jwks_uri": f"{self.base}/jwks",
                "userinfo_endpoint": f"{self.base}/userinfo", "response_types_supported": ["code"],
                "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": [self.method()]}

    def method(self) -> str:
        return str(self.faults.get("auth_method", self.auth_method))

    def claims(self, user: dict[str, Any]) -> dict[str, Any]:
        return {"sub": "sub-" + hashlib.sha256(user["username"].encode()).hexdigest()[:16],
                "preferred_username": user["username"], "email": f"{user['username']}@example.org",
                "groups": user["groups"]}

    def id_token(self, grant: dict[str, Any]) -> str:
        now = int(time.time())
        claims = self.claims(grant)
        if self.faults.get("groups_in") == "userinfo":
            claims.pop("groups")
        claims.update({"iss": self.base, "aud": self.faults.get("aud", self.client_id), "iat": now,
                       "exp": now + int(self.faults.get("exp", 300)),
                       "nonce": "not-the-nonce" if self.faults.get("nonce") == "wrong" else grant["nonce"]})
        kid, key = self.keys[0]
        if self.faults.get("sign") == "foreign":
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


def _challenge(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()


def _error(code: str, description: str, status: int = 400) -> Response[Any]:
    return Response({"error": code, "error_description": description}, status_code=status)


def make_app(p: Provider) -> Litestar:
    @get("/.well-known/openid-configuration")
    async def discovery() -> dict[str, Any]:
        return p.discovery()

    @get("/jwks")
    async def jwks() -> dict[str, Any]:
        return p.jwks()

    @get("/authorize")
    async def authorize(request: Request[Any, Any, Any]) -> Response[Any]:
        q = dict(request.query_params)
        if q.get("client_id") != p.client_id or q.get("response_type") != "code":
            return Response("unknown client or response type", status_code=400, media_type="text/plain")
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            return Response("PKCE with S256 is required", status_code=400, media_type="text/plain")
        if "openid" not in q.get("scope", "").split():
            return Response("the openid scope is required", status_code=400, media_type="text/plain")
        hidden = "".join(f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
                         for k, v in q.items())
        page = ("<!doctype html><html lang=en><head><title>Test identity provider</title></head><body><main>"
                "<h1>Test identity provider</h1><form method=post action=/authorize>" + hidden +
                "<label for=u>Username</label> <input id=u name=username required> "
                "<label for=g>Groups</label> <input id=g name=groups> "
                "<button name=decision value=allow>Sign in</button> "
                "<button name=decision value=deny formnovalidate>Cancel</button></form></main></body></html>")
        return Response(page, media_type="text/html")

    @post("/authorize")
    async def authorized(data: Form) -> Response[Any]:
        target = data["redirect_uri"]
        if data.get("decision") == "deny":
            return Redirect(path=target + "?" + urlencode({"error": "access_denied", "state": data.get("state", "")}),
                            status_code=303)
        code = secrets.token_urlsafe(16)
        p.codes[code] = {"username": data["username"],
                         "groups": [g.strip() for g in data.get("groups", "").split(",") if g.strip()],
                         "nonce": data.get("nonce", ""), "challenge": data["code_challenge"],
                         "redirect_uri": target, "client_id": data["client_id"]}
        return Redirect(path=target + "?" + urlencode({"code": code, "state": data.get("state", "")}), status_code=303)

    @post("/token")
    async def token(request: Request[Any, Any, Any], data: Form) -> Response[Any]:
        basic = request.headers.get("authorization", "")
        p.requests.append({"form": {k: v for k, v in data.items() if k != "client_secret"},
                           "basic": basic.startswith("Basic "), "secret_in_form": "client_secret" in data})
        if p.client_secret is not None and p.method() != "none":  # "none": a public client, PKCE alone
            if p.method() == "client_secret_basic":
                given = base64.b64decode(basic.removeprefix("Basic ")).decode() if basic else ""
                if given != f"{p.client_id}:{p.client_secret}":
                    return _error("invalid_client", "client authentication failed", 401)
            elif data.get("client_secret") != p.client_secret or data.get("client_id") != p.client_id:
                return _error("invalid_client", "client authentication failed", 401)
        grant = p.codes.pop(data.get("code", ""), None)
        if data.get("grant_type") != "authorization_code" or grant is None:
            return _error("invalid_grant", "unknown or used code")
        if data.get("redirect_uri") != grant["redirect_uri"]:
            return _error("invalid_grant", "redirect_uri differs from the authorization request's")
        if _challenge(data.get("code_verifier", "")) != grant["challenge"]:
            return _error("invalid_grant", "PKCE verification failed")
        access = secrets.token_urlsafe(16)
        p.tokens[access] = grant
        return Response({"access_token": access, "token_type": "Bearer", "expires_in": 300,
                         "id_token": p.id_token(grant)})

    @get("/userinfo")
    async def userinfo(request: Request[Any, Any, Any]) -> Response[Any]:
        grant = p.tokens.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if grant is None:
            return _error("invalid_token", "unknown access token", 401)
        return Response(p.claims(grant))

    @post("/control")
    async def control(data: dict[str, Any]) -> dict[str, Any]:
        if data.pop("rotate", False):
            p.rotate()
        p.faults = data
        return {"faults": p.faults}

    @get("/requests")
    async def requests() -> list[dict[str, Any]]:
        return p.requests

    return Litestar([discovery, jwks, authorize, authorized, token, userinfo, control, requests])


@contextlib.contextmanager
def running(client_id: str, client_secret: str | None) -> Iterator[str]:
    """This provider as a process on a free loopback port, for ``client_id``; yields its issuer URL."""
    from tests.helpers import free_port
    from tests.integration.conftest import stop, wait_http

    port = free_port()
    command = [sys.executable, "-m", "tests.oidc_provider", "--port", str(port), "--client-id", client_id]
    if client_secret is not None:
        command += ["--client-secret", client_secret]
    proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/jwks", proc)
        yield base
    finally:
        assert stop(proc), "the test identity provider must stop on SIGTERM"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client-id", required=True)
    parser.add_argument("--client-secret")
    parser.add_argument("--auth-method", default="client_secret_basic",
                        choices=["client_secret_basic", "client_secret_post", "none"])
    args = parser.parse_args()
    provider = Provider(f"http://127.0.0.1:{args.port}", args.client_id, args.client_secret, args.auth_method)
    uvicorn.run(make_app(provider), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
