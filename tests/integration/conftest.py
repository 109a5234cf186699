"""Real processes on loopback: simulated engines (`switchyard sim`) and gateways (`switchyard serve`).

One set of simulated engines serves the whole session; a gateway runs once over SQLite and once
over PostgreSQL, and every test that takes ``gateway`` runs against both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar.testing import TestClient
from playwright.sync_api import Browser, sync_playwright
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from switchyard.admin.session import CSRF_COOKIE, CSRF_HEADER, LOGIN_PATH
from switchyard.app import create_app
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.admin_users import create_user
from switchyard.store.keys import create_key
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant
from tests.conftest import SECRETS
from tests.helpers import free_port
from tests.unit.policy.base import base, to_yaml

ADMIN_TOKEN = "s3cret"  # the test gateways' admin token
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SECRETS.add(ADMIN_TOKEN)  # never logged (tests/conftest.py checks the session's logs)
BIN = Path(sys.executable).parent
SWITCHYARD = str(BIN / "switchyard") if (BIN / "switchyard").exists() else shutil.which("switchyard") or "switchyard"
SIM_TIME_SCALE = 20


def run_cli(args: Sequence[str], env: dict[str, str], *, check: bool = True,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``switchyard`` command (``switchyard.cli.main``) in this process, in the environment ``env``,
    with ``input_text`` on its standard input; its exit status and outputs as a process's would be.

    In this process, not a child: a ``switchyard`` process spends about a second of CPU importing itself, and the
    gateway tests make keys, tenants and console users by the hundred. The tests of the command line itself
    (``test_cli.py``, ``test_policy_cli.py``, ...) run it as a process, as an operator does.
    """
    from click.testing import CliRunner

    from switchyard.cli import main

    # (``env`` replaces the environment while the command runs; what it lacks is unset meanwhile.)
    unset: dict[str, str | None] = {name: None for name in os.environ if name not in env}
    result = CliRunner().invoke(main, list(args), input=input_text, env={**unset, **env}, catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    done = subprocess.CompletedProcess(["switchyard", *args], result.exit_code, result.stdout, stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"switchyard {' '.join(args)} failed ({done.returncode}): {stderr}")
    return done


def wait_http(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30.0) -> None:
    """Wait until ``url`` answers 200, failing early if ``proc`` dies."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = r.status
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout}s (last: {last})")


def http_json(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
              raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """A plain HTTP call (for what the SDK will not send); returns status, headers, JSON body.

    A call to the admin API carries the test gateways' admin token unless ``headers`` has an Authorization.
    """
    if "/admin/api/" in url and not any(k.lower() == "authorization" for k in headers or {}):
        headers = {**ADMIN_AUTH, **(headers or {})}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            payload = r.read()
            status, hdrs = r.status, dict(r.headers)
    except urllib.error.HTTPError as err:
        payload, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        parsed = json.loads(payload) if payload else None
    except json.JSONDecodeError:
        parsed = payload.decode("utf-8", "replace")
    return status, {k.lower(): v for k, v in hdrs.items()}, parsed


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """``check()``'s first truthy value, polling for up to ``timeout`` seconds (then its last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> bool:
    """SIGTERM, then wait; whether the process stopped cleanly by itself.

    uvicorn re-raises SIGTERM after its graceful shutdown, so -SIGTERM counts as clean; a
    process that had to be killed, or exited with an error, does not.
    """
    if proc.poll() is not None:
        return proc.returncode == 0
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"process {proc.pid} still running {timeout:g} s after SIGTERM; where its threads were:\n"
              f"{thread_stacks(proc.pid)}", file=sys.stderr)  # (shown with the failing test)
        proc.kill()
        proc.wait()
        return False
    return proc.returncode in (0, -signal.SIGTERM)


def thread_stacks(pid: int) -> str:
    """Every Python thread's stack in process ``pid`` (py-spy, of the dev extra that ``.ci/run`` installs), or why
    not: what a process that does not stop was doing."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(py-spy is not installed)"
    try:
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30,
                              check=False)
    except subprocess.TimeoutExpired:
        return "(py-spy dump took more than 30 s)"
    return (done.stdout + done.stderr).strip()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A database engine on a fresh database (SQLite and PostgreSQL), migrated to head."""
    engine = db.create_db_engine(database_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()


@dataclass
class Engines:
    """The simulated engines of the test policy."""

    policy_file: Path
    ports: dict[str, list[int]]
    dead_port: int

    def url(self, pool: str, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[pool][i]}"


def _policy_text(ports: dict[str, list[int]], dead_port: int) -> str:
    def eps(pool: str) -> str:
        return "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports[pool]) + "]"

    return f"""\
schema: 1
regions: [us-east, eu-west]
pools:
  - {{name: small-us, region: us-east, served_model: sim-small, endpoints: {eps("small-us")}, kv_cache_tokens: 200000}}
  - {{name: small-eu, region: eu-west, served_model: sim-small, endpoints: {eps("small-eu")}, kv_cache_tokens: 200000}}
  - {{name: large-us, region: us-east, served_model: sim-large, endpoints: {eps("large-us")}, kv_cache_tokens: 400000,
      sim_profile: h100-70b}}
  - {{name: hang-us, region: us-east, served_model: sim-hang, endpoints: {eps("hang-us")}, kv_cache_tokens: 100000}}
  - {{name: misnamed-us, region: us-east, served_model: not-what-it-serves, endpoints: {eps("misnamed-us")},
      kv_cache_tokens: 100000}}
  - {{name: dead-us, region: us-east, served_model: sim-dead, endpoints: [http://127.0.0.1:{dead_port}],
      kv_cache_tokens: 100000}}
models:
  - {{name: small, pools: [small-us, small-eu], context_window: 8192,
      price: {{input_per_mtok: 0.1, output_per_mtok: 0.2}}}}
  - {{name: large, pools: [large-us], context_window: 16384, price: {{input_per_mtok: 1, output_per_mtok: 3}}}}
  - {{name: hangs, pools: [hang-us], context_window: 4096, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: misnamed, pools: [misnamed-us], context_window: 4096, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
  - {{name: dead, pools: [dead-us], context_window: 4096, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
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
  - {{name: free, priority: sheddable, models: [auto, small]}}
  - {{name: pro, priority: standard, models: ["*"]}}
tests:
  - {{request: {{model: auto, tier: free, prompt: hi}}, expect: {{model: small}}}}
"""


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """Simulated engines for every pool of the test policy but ``dead-us`` (nothing listens there)."""
    ports = {"small-us": [free_port(), free_port()], "small-eu": [free_port()], "large-us": [free_port()],
             "hang-us": [free_port()], "misnamed-us": [free_port()]}
    dead_port = free_port()
    policy_file = tmp_path_factory.mktemp("policy") / "policies.yaml"
    policy_file.write_text(_policy_text(ports, dead_port))
    main = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(policy_file), "--time-scale", str(SIM_TIME_SCALE),
                             "--pool", "small-us", "--pool", "small-eu", "--pool", "large-us", "--pool", "hang-us"])
    # The misnamed pool's engine serves another model than the policy says.
    other = subprocess.Popen([SWITCHYARD, "sim", "--model", "sim-other", "--port", str(ports["misnamed-us"][0]),
                              "--time-scale", str(SIM_TIME_SCALE)])
    try:
        for pool, pool_ports in ports.items():
            for port in pool_ports:
                wait_http(f"http://127.0.0.1:{port}/health", main if pool != "misnamed-us" else other)
        yield Engines(policy_file, ports, dead_port)
    finally:
        stop(main)
        stop(other)


@dataclass
class Gateway:
    """A running `switchyard serve` process and how to reach it."""

    base_url: str
    env: dict[str, str]
    backend: str
    proc: subprocess.Popen[bytes]
    keys: dict[str, str] = field(default_factory=dict)
    console_users: set[str] = field(default_factory=set)

    def cli(self, *args: str, check: bool = True, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `switchyard ARGS` against this gateway's database and policy (``input_text`` on stdin; in this
        process: :func:`run_cli`)."""
        return run_cli(args, self.env, check=check, input_text=input_text)

    def new_key(self, tenant: str, tier: str) -> str:
        """A new API key for ``tenant`` (created in ``tier`` if new), made with the real CLI (and watched: it
        must never be logged)."""
        secret = self.cli("keys", "create", "--tenant", tenant, "--tier", tier).stdout.strip()
        SECRETS.add(secret)
        return secret

    def console(self, role: str = "admin") -> httpx.Client:
        """An HTTP client logged in to this gateway's console as a user of ``role`` (made once, with the
        real ``switchyard admin create-user``); its ``headers`` carry the CSRF token for writes."""
        username = f"{CONSOLE_USERS[role]}-{role}"
        if username not in self.console_users:
            self.cli("admin", "create-user", username, "--role", role, "--password-stdin", input_text=CONSOLE_PASSWORD)
            self.console_users.add(username)
        session = httpx.Client(base_url=self.base_url, timeout=30)
        session.get(LOGIN_PATH)
        token = session.cookies[CSRF_COOKIE]
        session.headers[CSRF_HEADER] = token
        login = session.post(LOGIN_PATH, data={"username": username, "password": CONSOLE_PASSWORD})
        assert login.status_code == 303, login.text
        return session


def client(gw: Gateway, key: str) -> openai.OpenAI:
    """The official SDK on ``gw`` with the key named ``key``; no retries of its own."""
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[key], max_retries=0, timeout=60)


def route(raw: openai.APIResponse[object]) -> dict[str, str]:
    """The parts of a response's ``x-switchyard-route`` header (``model``, ``pool``, ``endpoint``, ...)."""
    return dict(part.split("=", 1) for part in raw.headers["x-switchyard-route"].split("; "))


def endpoints(gw: Gateway) -> dict[str, dict[str, object]]:
    """``/admin/api/endpoints`` by URL: health, in-flight count and scraped signals of each endpoint."""
    status, _, body = http_json("GET", gw.base_url + "/admin/api/endpoints")
    assert status == 200
    return {row["url"]: row for row in body["endpoints"]}


def gateway_counter(gw: Gateway, name: str, **labels: str) -> float:
    """The sum of a gateway's ``name`` samples whose labels include ``labels``."""
    return metric_sum(gw.base_url, name, **labels)


def metric_sum(base_url: str, name: str, **labels: str) -> float:
    """The sum of the ``name`` samples whose labels include ``labels`` in ``base_url``'s ``/metrics`` (a gateway's
    or an engine's)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


GATEWAY_SETTINGS = {
    "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "3",
    "SWITCHYARD_KEY_CACHE_TTL_S": "0.3",
    "SWITCHYARD_MAX_BODY_BYTES": "1000000",
    "SWITCHYARD_LOG_LEVEL": "warning",
    "SWITCHYARD_ADMIN_TOKEN": ADMIN_TOKEN,
}


def start_gateway(engines: Engines, database_url: str, data_dir: Path, backend: str,
                  extra_env: dict[str, str] | None = None, log_file: Path | None = None) -> Gateway:
    """Start `switchyard serve` on a free port and wait until it is ready (its standard error to
    ``log_file`` when given)."""
    port = free_port()
    env = {**os.environ, **GATEWAY_SETTINGS, "SWITCHYARD_DATA_DIR": str(data_dir),
           "SWITCHYARD_DATABASE_URL": database_url, "SWITCHYARD_POLICY_FILE": str(engines.policy_file),
           "SWITCHYARD_PORT": str(port), **(extra_env or {})}
    if log_file is None:
        proc = subprocess.Popen([SWITCHYARD, "serve"], env=env)
    else:
        with log_file.open("ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([SWITCHYARD, "serve"], env=env, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/readyz", proc)
    except BaseException:
        stop(proc)
        raise
    return Gateway(base, env, backend, proc)


@dataclass
class FaultFleet:
    """Simulated engines in one ``switchyard sim`` process with its fault control server, and the folder of the
    policies written for them (``<name>.yaml``)."""

    ports: dict[str, int]
    control: str
    folder: Path
    #: Databases with the keys of each set already made (see :meth:`gateway`).
    _databases: dict[tuple[tuple[str, tuple[str, str]], ...], tuple[Path, dict[str, str]]] = field(
        default_factory=dict)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def fault(self, **body: Any) -> list[dict[str, Any]]:
        """Set faults through the sim's control server (targets: region, pool, port; none: every engine)."""
        status, _, answer = http_json("POST", self.control + "/faults", body)
        assert status == 200, answer
        return list(answer["engines"])

    def down(self, *names: str, **settings: Any) -> None:
        """Set ``settings`` on the engines named."""
        for name in names:
            self.fault(port=self.ports[name], **settings)

    def state(self, name: str) -> dict[str, Any]:
        """The engine's ``/sim/state``."""
        status, _, body = http_json("GET", self.url(name) + "/sim/state")
        assert status == 200
        return dict(body)

    def gateway(self, tmp_path: Path, policy: str, env: dict[str, str],
                keys: dict[str, tuple[str, str]]) -> Gateway:
        """A gateway in us-east on policy ``<policy>.yaml``, with ``keys`` (name → tenant, tier).

        The keys are made once per set (with the real CLI) in a database the fleet keeps; each gateway starts on
        a copy of it, so that a fresh gateway per test costs no key creation.
        """
        wanted = tuple(sorted(keys.items()))
        made = self._databases.get(wanted)
        if made is None:
            template = self.folder / f"keys-{len(self._databases)}.db"
            cli_env = {**os.environ, **GATEWAY_SETTINGS, "SWITCHYARD_DATA_DIR": str(self.folder),
                       "SWITCHYARD_DATABASE_URL": f"sqlite:///{template}",
                       "SWITCHYARD_POLICY_FILE": str(self.folder / f"{policy}.yaml")}
            run_cli(["db", "upgrade"], cli_env)
            tenants = dict(keys.values())
            assert len(tenants) == len(keys), "one key per tenant (keys create-many makes one each)"
            done = run_cli(["keys", "create-many"], cli_env,
                           input_text="".join(f"{t} {tier}\n" for t, tier in tenants.items()))
            by_tenant: dict[str, str] = json.loads(done.stdout)
            secrets = {name: by_tenant[tenant] for name, (tenant, _) in keys.items()}
            for secret in secrets.values():
                SECRETS.add(secret)
            made = self._databases[wanted] = (template, secrets)
        template, secrets = made
        database = tmp_path / "gw.db"
        shutil.copyfile(template, database)
        gw = start_gateway(Engines(self.folder / f"{policy}.yaml", {}, 0), f"sqlite:///{database}", tmp_path,
                           "sqlite", {"SWITCHYARD_REGION": "us-east", **env})
        gw.keys.update(secrets)
        return gw


#: The faults a fault-injecting engine is cleared of (POST /_fault): every kind off.
FAULTS_CLEAR = {"mode": "none", "error_rate": 0, "throttle_rate": 0, "overload_rate": 0, "abort_rate": 0,
                "abort_with": "close"}


def fault_fleet(folder: Path, names: Sequence[str], policies: Callable[[dict[str, int]], dict[str, str]],
                serve: str, time_scale: float = 20) -> Iterator[FaultFleet]:
    """Start the engines ``names`` on free ports, as the policy ``serve`` of ``policies(ports)`` declares them
    (every policy written to ``folder``), with a fault control server; stop them at the end."""
    ports = {name: free_port() for name in names}
    control = free_port()
    for name, text in policies(ports).items():
        (folder / f"{name}.yaml").write_text(text)
    proc = subprocess.Popen([SWITCHYARD, "sim", "--policy", str(folder / f"{serve}.yaml"), "--time-scale",
                             f"{time_scale:g}", "--control-port", str(control)])
    try:
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        wait_http(f"http://127.0.0.1:{control}/health", proc)
        yield FaultFleet(ports, f"http://127.0.0.1:{control}", folder)
    finally:
        stop(proc)


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def gateway(request: pytest.FixtureRequest, engines: Engines, tmp_path_factory: pytest.TempPathFactory,
            pg_database: Callable[[], str]) -> Iterator[Gateway]:
    """A gateway over the test engines, once on SQLite and once on PostgreSQL, with keys per tier."""
    data_dir = tmp_path_factory.mktemp(f"gw-{request.param}")
    url = f"sqlite:///{data_dir / 'switchyard.db'}" if request.param == "sqlite" else pg_database()
    gw = start_gateway(engines, url, data_dir, request.param)
    try:
        gw.keys = {"free": gw.new_key("free-co", "free"), "pro": gw.new_key("pro-co", "pro")}
        yield gw
    finally:
        assert stop(gw.proc), "the gateway must stop cleanly on SIGTERM"


@pytest.fixture
def admin_client(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """An in-process gateway app (test client) with tenant acme (tier free) and one key, admin token set."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(to_yaml(base()))
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy, admin_token=ADMIN_TOKEN)
    with TestClient(app=create_app(settings)) as c:
        with db.session_scope(c.app.state.runtime.engine) as session:
            create_tenant(session, TenantCreate(name="acme", tier="free"))
            create_key(session, "acme")
        yield c


# --- the console -------------------------------------------------------------------------------

CONSOLE_PASSWORD = "correct horse battery"  # a test user's password
SECRETS.add(CONSOLE_PASSWORD)
CONSOLE_USERS = {"viewer": "vera", "operator": "otto", "admin": "ada"}


def add_console_users(engine: Engine) -> None:
    """One console user per role (``CONSOLE_USERS``), all with ``CONSOLE_PASSWORD``."""
    with db.session_scope(engine) as session:
        for role, name in CONSOLE_USERS.items():
            create_user(session, name, CONSOLE_PASSWORD, role, actor="test", origin="test")


def csrf_headers(client: TestClient[Any]) -> dict[str, str]:
    """The CSRF header a console write needs (the token is the CSRF cookie's value)."""
    token = client.cookies.get(CSRF_COOKIE)
    if token is None:
        client.get(LOGIN_PATH)  # a safe request sets the cookie
        token = client.cookies.get(CSRF_COOKIE)
    assert token is not None
    return {CSRF_HEADER: token}


def console_login(client: TestClient[Any], role: str, password: str = CONSOLE_PASSWORD) -> Any:
    """Log ``client`` in as the test user of ``role``; returns the login answer (303 when it worked)."""
    return client.post(LOGIN_PATH, data={"username": CONSOLE_USERS.get(role, role), "password": password,
                                         "next": "/admin/"}, headers=csrf_headers(client), follow_redirects=False)


@pytest.fixture
def console(admin_client: TestClient[Any]) -> TestClient[Any]:
    """``admin_client`` with the three console users, logged in as the admin."""
    add_console_users(admin_client.app.state.runtime.engine)
    assert console_login(admin_client, "admin").status_code == 303
    return admin_client


# --- the browser -------------------------------------------------------------------------------

#: The Chromium the console's browser tests drive (Debian's package; Playwright's own download cannot work here).
CHROMIUM = os.environ.get("SWITCHYARD_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:
        message = "no Chromium (apt-get install -y chromium, or set SWITCHYARD_CHROMIUM)"
        if os.environ.get("SWITCHYARD_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield launched
        finally:
            launched.close()
