"""Fuzzing the gateway through its own OpenAPI document (``/openapi``) with schemathesis.

A gateway of this module's own (its own database, publishes and limit overrides do not leak into other
tests) over the session's simulated engines is sent what schemathesis makes of every operation the
document declares, the OpenAI-compatible routes and the admin API: valid and invalid bodies, parameters
and headers (positive and negative generation, the coverage phase's boundary values, then random cases),
mostly with a valid API key or admin token so that the cases get past authentication, some with none or
a wrong one. Every answer must be:

- no 5xx (the engines are healthy; a 5xx is a bug of the gateway),
- an error object when it is an error: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, for
  the admin API the same with ``issues`` when a policy was refused, whatever the status (also the 405 for
  a method the document does not declare),
- what the document declares: the status, the content type, the body's schema, auth enforced, an invalid
  case refused and (where validity is the document's to say) a valid one accepted;

and the gateway's log must hold no error and no warning of Switchyard's when it stops (a bug can hide behind
a fine answer: a request log that can no longer write what a case left in it).

The suite runs a small, derandomized fuzz (the same 1,250-odd cases on every run, about half a minute);
``SWITCHYARD_FUZZ_EXAMPLES=2000`` runs up to that many random cases per operation instead (on demand: about
a minute per 100 cases of every operation on two cores, so some 20 minutes), ``SWITCHYARD_FUZZ_SEED`` draws
others and ``SWITCHYARD_FUZZ_DATABASE=sqlite`` fuzzes over SQLite. Chat and completion cases are steered
to a model of the policy half the time, with the output they may ask for kept small, so that they reach
admission, the cache, flow control and the engines without making the simulated engines generate for long
(unsteered, a random model name is a 404; the engine itself refuses more than its context).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.specs.openapi.checks import positive_data_acceptance
from sqlalchemy import text

from switchyard.app import create_app
from switchyard.settings import Settings
from switchyard.store import db
from tests.integration.conftest import ADMIN_TOKEN, Engines, Gateway, eventually, http_json, start_gateway, stop

#: Random cases per operation (the fuzzing phase), beside the coverage phase's.
EXAMPLES = int(os.environ.get("SWITCHYARD_FUZZ_EXAMPLES", "6"))
SEED = int(os.environ.get("SWITCHYARD_FUZZ_SEED", "20251"))
#: The fuzz gateway's database: PostgreSQL by default (stricter than SQLite: NUL characters, 32-bit integers).
DATABASE = os.environ.get("SWITCHYARD_FUZZ_DATABASE", "postgresql")
#: The models of the fuzz policy a chat or completion case is steered to.
MODELS = ("small", "large", "auto")
#: The most output a steered case may ask for (the engines stay quick).
MAX_OUTPUT = 16


def _policy(engines: Engines) -> str:
    """The fuzz policy: healthy pools only (a fuzzed case cannot name a pool that is down on purpose), limits
    and a response cache so that cases reach admission and the cache."""
    def eps(pool: str) -> str:
        return "[" + ", ".join(engines.url(pool, i) for i in range(len(engines.ports[pool]))) + "]"

    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: small-us, region: us-east, served_model: sim-small, endpoints: {eps("small-us")}, kv_cache_tokens: 200000}}
  - {{name: small-eu, region: eu-west, served_model: sim-small, endpoints: {eps("small-eu")}, kv_cache_tokens: 200000}}
  - {{name: large-us, region: us-east, served_model: sim-large, endpoints: {eps("large-us")}, kv_cache_tokens: 400000,
      sim_profile: h100-70b}}
models:
  - {{name: small, pools: [small-us, small-eu], context_window: 8192, max_output_tokens: 1024,
      price: {{input_per_mtok: 0.1, output_per_mtok: 0.2}}}}
  - {{name: large, pools: [large-us], context_window: 16384, price: {{input_per_mtok: 1, output_per_mtok: 3}}}}
routes:
  - name: auto
    rules:
      - {{name: hard, when: {{match: "(?i)prove"}}, model: large}}
      - {{name: short, when: {{prompt_tokens_lt: 200}}, model: small}}
    default: large
priorities:
  standard: {{max_queue_ms: 1000}}
  sheddable: {{max_queue_ms: 100}}
tiers:
  - {{name: free, priority: sheddable, models: [auto, small], limits: {{tokens_per_minute: 20000}}}}
  - {{name: pro, priority: standard, models: ["*"]}}
cache:
  - {{name: exact-small, match: {{models: [small]}}, mode: exact, ttl: 1h, scope: tenant}}
"""


@pytest.fixture(scope="module")
def fuzz_gateway(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
                 pg_database: Callable[[], str]) -> Iterator[Gateway]:
    """A gateway of this module's own (a fresh database; the policy in it, so that publishes and rollbacks run)."""
    data_dir = tmp_path_factory.mktemp("gw-fuzz")
    policy = data_dir / "fuzz-policy.yaml"
    policy.write_text(_policy(engines))
    fuzz_engines = Engines(policy, engines.ports, engines.dead_port)
    url = f"sqlite:///{data_dir / 'switchyard.db'}" if DATABASE == "sqlite" else pg_database()
    gw = start_gateway(fuzz_engines, url, data_dir, DATABASE, extra_env={"SWITCHYARD_POLICY_SOURCE": "db"},
                       log_file=data_dir / "gateway.log")
    try:
        gw.keys = {"free": gw.new_key("free-co", "free"), "pro": gw.new_key("pro-co", "pro")}
        KEYS.update(gw.keys)
        yield gw
    finally:
        assert stop(gw.proc), "the gateway must stop cleanly on SIGTERM"
        _report_log(data_dir / "gateway.log")


def _report_log(log: Path) -> None:
    """Fail on an error or a warning of Switchyard's the gateway logged: a bug it answered 500 to, or one that
    no answer shows (a request log that cannot write what a case left in it)."""
    content = log.read_text(errors="replace") if log.exists() else ""
    bad = [line for line in content.splitlines() if " ERROR " in line or " WARNING switchyard" in line]
    assert not bad, "the gateway logged:\n" + "\n".join(bad[:20]) + f"\n\n{content[-6000:]}"


def _document() -> dict[str, Any]:
    """The gateway's OpenAPI document as the app builds it (nothing is started; the test below checks that
    a running gateway serves the same)."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=f"sqlite:///{tmp}/unused.db",
                            policy_file=Path(tmp) / "policies.yaml", admin_token=ADMIN_TOKEN)
        document: dict[str, Any] = create_app(settings).openapi_schema.to_schema()
        return document


DOCUMENT = _document()
#: Where validity depends on more than the document can say, a valid-looking case may be refused (400): the
#: engine checks the fields the gateway passes on; a tier's limits need tokens_per_minute <= tokens_per_day;
#: the request list's status filter is lenient (case, spaces). The other checks still run there.
BEYOND_THE_DOCUMENT = ["createChatCompletion", "createCompletion", "adminTenantLimits", "adminKeyLimits",
                       "adminRequests"]
schema = schemathesis.openapi.from_dict(DOCUMENT, config=schemathesis.Config.from_dict({
    "seed": SEED,
    "request-timeout": 30,
    "generation": {"mode": "all", "max-examples": EXAMPLES, "deterministic": True, "database": "none"},
    "phases": {
        "examples": {"enabled": False},
        "stateful": {"enabled": False},
        # Every method the document does not declare must be a 405 with Allow (OPTIONS is left out: Litestar
        # 2.25's automatic OPTIONS answer lists only the first handler's methods of a path with several).
        "coverage": {"unexpected-methods": ["get", "put", "post", "delete", "patch", "trace"]},
    },
    # A valid case may be refused for what the document declares (422: a policy's meaning; 404, 409: state).
    "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "403", "404", "409", "422", "429"]}},
    "operations": [{"include-operation-id": BEYOND_THE_DOCUMENT,
                    "checks": {"positive_data_acceptance": {"enabled": False}}}],
}))

_ERROR_FIELDS = {"message", "type", "param", "code"}


@schemathesis.check
def error_object(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every error is an error object (OpenAI's; the admin API's adds ``issues``), whatever its status."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code}: not JSON: {response.content[:200]!r}") from None
    allowed = {"error", "issues"} if case.path.startswith("/admin/api/") else {"error"}
    assert isinstance(body, dict), f"{response.status_code}: not an object: {body!r}"
    assert set(body) <= allowed and "error" in body, f"{response.status_code}: not an error object: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == _ERROR_FIELDS, f"{response.status_code}: {body!r}"
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), body
    return None


#: The API keys of the fuzz gateway (by tier), once it runs.
KEYS: dict[str, str] = {}
_turns = itertools.count()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schema.auth(refresh_interval=None, retry_on=[])
class Credentials:
    """Most cases carry a valid API key (pro or free) or the admin token; every tenth none and every tenth a
    wrong one (the same cases on every run: they come in a fixed order). Beside these, schemathesis's
    ``ignored_auth`` check sends each operation that succeeded again without and with a wrong token."""

    def get(self, case: Case, ctx: schemathesis.AuthContext) -> str:
        return "switchyard"

    def set(self, case: Case, data: str, ctx: schemathesis.AuthContext) -> None:
        turn = next(_turns)
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if turn % 10 == 3:
            headers["Authorization"] = "Bearer sk-sy-not-a-key"
        elif turn % 10 != 7:  # (the coverage phase's cases are made before the gateway runs: see _keyed)
            token = ADMIN_TOKEN if case.path.startswith("/admin/api/") else "pro" if turn % 3 else "free"
            headers["Authorization"] = f"Bearer {token}"
        case.headers = headers


def _keyed(case: Case) -> None:
    """The fuzz gateway's real keys in place of the tier names :class:`Credentials` put in."""
    auth = (case.headers or {}).get("Authorization", "")
    tier = auth.removeprefix("Bearer ")
    if tier in KEYS:
        case.headers = {**case.headers, "Authorization": f"Bearer {KEYS[tier]}"}


def _steer(case: Case) -> None:
    """Half the chat and completion cases name a model of the policy and ask for little output (set
    anew, so that schemathesis judges the case by what is sent)."""
    if case.path not in ("/v1/chat/completions", "/v1/completions") or not isinstance(case.body, dict):
        return
    turn = next(_turns)
    if turn % 2:
        return
    body = {**case.body, "model": MODELS[turn // 2 % len(MODELS)]}
    for key in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(key)) and body[key] > MAX_OUTPUT:
            body[key] = MAX_OUTPUT
    if _is_int(body.get("n")) and body["n"] > 2:
        body["n"] = 2
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_OUTPUT
    case.body = body


@pytest.mark.timeout(max(120, 60 * EXAMPLES))
@schema.parametrize()
def test_fuzz(case: Case, fuzz_gateway: Gateway) -> None:
    """No 5xx, errors as error objects, and what the document declares, for every case."""
    _keyed(case)
    _steer(case)
    # PostgreSQL text cannot hold NUL: a valid-looking case with one is refused (400) where it reaches the database.
    nul = "\\x00" in repr((case.path_parameters, case.query, case.headers, case.body))
    case.call_and_validate(base_url=fuzz_gateway.base_url, additional_checks=[error_object],
                           excluded_checks=[positive_data_acceptance] if nul else None)


def test_the_gateway_serves_the_fuzzed_document(fuzz_gateway: Gateway) -> None:
    with urllib.request.urlopen(f"{fuzz_gateway.base_url}/openapi/openapi.json", timeout=10) as r:
        assert json.loads(r.read()) == DOCUMENT


def test_the_document_declares_every_json_api() -> None:
    """The fuzzed document covers the OpenAI-compatible routes and the admin API, with request bodies and
    error responses; the console's pages and static files stay out of it."""
    paths = DOCUMENT["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files", "/v1/batches",
            "/admin/api/policy/versions", "/admin/api/cache/purge"} <= set(paths)
    assert not [p for p in paths if p.startswith(("/admin/", "/static")) and not p.startswith("/admin/api/")]
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "messages"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            errors = {s for s in operation["responses"] if s.startswith(("4", "5"))}
            assert {"401", "500"} <= errors, f"{method.upper()} {path} declares {sorted(errors)}"
            for status in errors:
                schema_ = operation["responses"][status]["content"]["application/json"]["schema"]
                assert schema_["required"][0] == "error", f"{method.upper()} {path} {status}"


def test_what_fuzzing_found(fuzz_gateway: Gateway) -> None:
    """The cases the fuzzer found, kept: each was a 500 (or a request log that stopped writing)."""
    gw = fuzz_gateway
    key = {"Authorization": f"Bearer {gw.keys['pro']}"}

    def answer(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        status, _, got = http_json(method, gw.base_url + path, body, headers=headers)
        assert status < 400 or (isinstance(got, dict) and set(got.get("error", {})) == _ERROR_FIELDS), (path, got)
        return status, got

    # A message's role that cannot be looked up in a set (a list) was a TypeError.
    status, got = answer("POST", "/v1/chat/completions", {"model": "small", "messages": [{"role": [None]}]}, key)
    assert status == 400 and got["error"]["param"] == "messages[0].role"
    # Ids and version numbers beyond the database's integers reached the driver.
    for path in ("/admin/api/policy/versions/-236645976609672298233856", "/admin/api/policy/versions/2147483648"):
        assert answer("GET", path)[0] == 400
    assert answer("PUT", "/admin/api/keys/99999999999/region", {"region": None})[0] == 400
    assert answer("GET", "/admin/api/policy/diff?from=v99999999999")[0] == 404
    assert answer("GET", "/admin/api/policy/diff?from=%C2%B2")[0] == 400  # '²' is a digit to str.isdigit only
    # An author longer than the audit log's column (SQLite stores it, then the audit entry's model refused it).
    for path, body in (("/admin/api/cache/purge", {"author": "x" * 129}),
                       ("/admin/api/keys/1/limits", {"limits": {}, "author": "x" * 129})):
        assert answer("PUT" if "limits" in path else "POST", path, body)[0] == 400, path
    # A JSON number is a version whatever its spelling; a fraction is not.
    assert answer("POST", "/admin/api/policy/rollback", {"version": 1.0})[0] in (200, 201)
    assert answer("POST", "/admin/api/policy/rollback", {"version": 1.5})[0] == 400
    # PostgreSQL refuses NUL in text and text longer than its column: those were 500s, now 400s (SQLite takes
    # both, so there they are whatever the lookup finds).
    refused = (400,) if DATABASE == "postgresql" else (400, 404)
    for method, path, body in (("GET", "/admin/api/usage?tenant=a%00b", None),
                               ("PUT", "/admin/api/tenants/a%00b/region", {"region": None}),
                               ("POST", "/admin/api/cache/purge", {"tenant": "a\x00b"})):
        assert answer(method, path, body)[0] in refused, path
    for method, path, body in (("GET", "/v1/files/a%00b", None), ("GET", "/v1/batches?after=a%00b", None),
                               ("POST", "/v1/batches", {"input_file_id": "file-\x00", "endpoint": "/v1/completions",
                                                        "completion_window": "24h"})):
        assert answer(method, path, body, key)[0] in refused, path
    # A value the request log's columns cannot hold (a long or NUL model name, a huge max_tokens) failed every
    # flush after it, so nothing more was logged.
    long_name, nul_name = "m" * 300, "a\x00b"
    for model, max_tokens in ((long_name, 2), (nul_name, 10**12), ("small", 2)):
        answer("POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": max_tokens}, key)
    engine = db.create_db_engine(gw.env["SWITCHYARD_DATABASE_URL"])
    try:
        def logged() -> set[tuple[str, int]]:
            with engine.connect() as conn:
                return {(row[0], row[1]) for row in conn.execute(
                    text("SELECT model, max_tokens FROM request_log WHERE status = 404"))}
        expected = {(long_name[:256], 2), ("a\ufffdb", 2**31 - 1)}
        rows = eventually(lambda: expected <= logged() and logged(), timeout=10) or logged()
        assert expected <= rows, rows
    finally:
        engine.dispose()
