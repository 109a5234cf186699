"""``switchyard demo``: gateway + console + simulated engines for every pool, in one command."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import click

from switchyard.cli.context import cli_context
from switchyard.resources import demo_policy
from switchyard.store.errors import NotFound

if TYPE_CHECKING:
    from switchyard.policy import PolicySnapshot
    from switchyard.settings import Settings

DEMO_TENANT = "demo"
DEMO_ADMIN = "admin"
#: Port of the simulated engines' fault control server (the next lower one if the policy uses it).
SIM_CONTROL_PORT = 8390


#: Where a demo moves its ports when the usual ones are taken (another demo, or anything else): the
#: gateway, every engine (with its KV-event ports) and the fault control server all by the same step.
PORT_STEP = 100
PORT_TRIES = 20
SIM_POLICY_HEADER = ("# Written by `switchyard demo` for its simulated engines: the policy it serves is in\n"
                     "# the database (edit it in the console); this copy is rewritten at every start.\n")


def _port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be listened on. With address reuse, as the servers bind: a socket of a
    demo just stopped, waiting in TIME_WAIT, does not make its port read as taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _engine_ports(snapshot: PolicySnapshot) -> list[tuple[str, int, str]]:
    """Every (host, port, what) the simulated engines of ``snapshot`` listen on."""
    ports: list[tuple[str, int, str]] = []
    for pool in snapshot.pools.values():
        for url in pool.endpoints:
            parts = urlsplit(url)
            if parts.port is None:
                continue
            host = parts.hostname or "127.0.0.1"
            ports.append((host, parts.port, f"engine {url} (pool {pool.name})"))
            if pool.kv_events is not None and not pool.kv_events.sockets:
                events, replay = pool.kv_events.addresses(url)
                for what, address in (("KV events", events), ("KV-event replay", replay)):
                    if address is not None and address.startswith("tcp://"):
                        ports.append((host, int(address.rsplit(":", 1)[1]), f"{what} of {url}"))
    return ports


def _busy(ports: list[tuple[str, int, str]]) -> list[str]:
    return [f"{host}:{port} ({what})" for host, port, what in ports if not _port_free(host, port)]


def _moved_endpoints(text: str, step: int) -> str:
    """``text`` with every pool endpoint's port moved by ``step`` (comments and layout kept)."""
    import io

    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    document = yaml.load(text)
    for pool in document.get("pools") or []:
        endpoints = pool.get("endpoints") or []
        for i, url in enumerate(endpoints):
            parts = urlsplit(str(url))
            if parts.port is not None:
                endpoints[i] = parts._replace(netloc=parts.netloc.rsplit(":", 1)[0] + f":{parts.port + step}").geturl()
    out = io.StringIO()
    yaml.dump(document, out)
    return out.getvalue()


def _wait_http(url: str, timeout_s: float, child: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise click.ClickException(f"{what} exited with code {child.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise click.ClickException(f"{what} did not become ready at {url} within {timeout_s:.0f}s")


def _demo_key(settings: Settings, snapshot: PolicySnapshot) -> tuple[str, str]:
    from switchyard.store import db as store_db
    from switchyard.store.audit import append_event
    from switchyard.store.keys import create_key
    from switchyard.store.models import TenantCreate
    from switchyard.store.tenants import create_tenant, get_tenant

    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        store_db.upgrade(engine)
        with store_db.session_scope(engine) as session:
            try:
                tier = get_tenant(session, DEMO_TENANT).tier
            except NotFound:
                tier = "pro" if "pro" in snapshot.tiers else next(iter(snapshot.tiers))
                create_tenant(session, TenantCreate(name=DEMO_TENANT, tier=tier))
                append_event(session, actor="demo", origin="cli demo", action="tenant.create",
                             target=f"tenant:{DEMO_TENANT}", detail={"tier": tier})
            label = f"demo {time.strftime('%Y-%m-%d %H:%M:%S')}"
            secret, record = create_key(session, DEMO_TENANT, label)
            append_event(session, actor="demo", origin="cli demo", action="key.create", target=f"key:{record.id}",
                         detail={"tenant": DEMO_TENANT, "prefix": record.prefix, "name": label, "region": None})
    finally:
        engine.dispose()
    return secret, tier


def _demo_console_user(settings: Settings) -> str:
    """A console admin for the demo (made with a random password the first time), as a banner line."""
    from switchyard.store import db as store_db
    from switchyard.store.admin_users import create_user, list_users, use_hash_profile

    use_hash_profile(settings.password_hash_profile)
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        with store_db.session_scope(engine) as session:
            if list_users(session):
                return "log in as a user made before (switchyard admin users / set-password)"
            password = secrets.token_urlsafe(12)
            create_user(session, DEMO_ADMIN, password, "admin", actor="demo", origin="cli demo")
    finally:
        engine.dispose()
    return f"user {DEMO_ADMIN}, password {password} (shown once)"


def _policy_label(base: str, fallback: str) -> str:
    """The version the gateway serves (it numbers the policy when it records it)."""
    try:
        with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:  # noqa: S310 - loopback only
            return str(json.load(response)["checks"]["policy"]["version"])
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return fallback


def _control_port(taken: set[int], start: int = SIM_CONTROL_PORT) -> int:
    """``start``, or the first port below it that the gateway and the policy leave alone."""
    port = start
    while port in taken:
        port -= 1
    return port


def _banner(base: str, key: str, tier: str, snapshot: PolicySnapshot, engines: int, region: str,
            control: str, console_login: str) -> str:
    model = "auto" if "auto" in snapshot.routes else next(iter(snapshot.models))
    other = next((r for r in snapshot.document.regions if r != region), region)
    return f"""
Switchyard demo is running ({engines} simulated vLLM engines, policy {_policy_label(base, snapshot.label)}).
The gateway runs in region {region}: requests are served there and spill over to another region when
it is saturated (header x-switchyard-region: REGION names another home).

  API (OpenAI-compatible)  {base}/v1
  Admin console            {base}/admin/
    {console_login}
  Metrics                  {base}/metrics
  API key (tenant {DEMO_TENANT}, tier {tier}; shown once)
    {key}

Try it:

  curl -s {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hi there"}}], "max_tokens": 32}}' -i

  pip install openai && python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=64,
        messages=[{{"role": "user", "content": "Prove that there are infinitely many primes."}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

Inject faults into the simulated engines (down = connection refused; also --mode unavailable|hang|slow,
--error-rate, --throttle-rate, --overload-rate, --abort-rate; --pool or --port to pick fewer engines):

  switchyard sim fault --control {control} --region {other} --mode down
  switchyard sim faults --control {control}
  switchyard sim fault --control {control} --clear

Press Ctrl-C to stop everything.
"""


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _seed_file(settings: Settings) -> Path:
    """The policy file the demo starts from: the one the settings name when it exists, else the data
    folder's copy of the demo policy (copied there the first time only: edits to it are kept)."""
    if settings.policy_file.exists():
        return settings.policy_file
    copy = settings.data_dir / "policies.yaml"
    if copy.exists():
        click.echo(f"no {settings.policy_file} here; using {copy} (the demo policy as this folder's demo left it)")
    else:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(demo_policy(), copy)
        click.echo(f"no {settings.policy_file} here; using the demo policy, copied to {copy}")
    return copy


def _stored_text(settings: Settings) -> tuple[str, int] | None:
    """The active version's text and number in the database, if there is one (the tables made first)."""
    from switchyard.store import db as store_db
    from switchyard.store.policy_versions import active_version

    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        store_db.upgrade(engine)
        with store_db.session_scope(engine) as session:
            row = active_version(session)
            return (row.yaml_text, row.number) if row is not None else None
    finally:
        engine.dispose()


def _free_step(settings: Settings, snapshot: PolicySnapshot, *, gateway_fixed: bool, movable: bool) -> int:
    """By how much to move the demo's ports (0: the usual ones are free).

    Raises:
        click.ClickException: no free set of ports (or, when the engines cannot move, the busy ones).
    """
    engines = _engine_ports(snapshot)
    first: list[str] = []
    for attempt in range(PORT_TRIES if movable else 1):
        step = attempt * PORT_STEP
        ports = [(host, port + step, what) for host, port, what in engines]
        ports.append(("127.0.0.1", _control_port({settings.port + (0 if gateway_fixed else step),
                                                  *(p for _, p, _ in ports)}, SIM_CONTROL_PORT + step),
                      "simulator fault control"))
        ports.append((settings.host, settings.port + (0 if gateway_fixed else step), "gateway"))
        busy = _busy(ports)
        if not busy:
            return step
        first = first or busy
        if gateway_fixed and not _port_free(settings.host, settings.port):
            break  # the port asked for is taken: moving the rest does not help
    hint = (" (another demo running? stop it, or give another --port)" if movable else
            " (another demo running? stop it, change the endpoints in the policy file, or run with "
            "--policy-source db: the demo then moves its engines to free ports)")
    raise click.ClickException("ports already in use: " + ", ".join(first) + hint)


def _publish_moved(settings: Settings, text: str, step: int) -> int:
    """Record ``text`` (the engines moved by ``step``) as the active version; returns its number."""
    from switchyard.store import db as store_db
    from switchyard.store.policy_versions import publish

    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        with store_db.session_scope(engine) as session:
            row, _created = publish(session, text, source="cli", author="demo", origin="cli demo",
                                    message=f"the demo's engines moved by {step:+d} ports: the usual ones were taken")
    finally:
        engine.dispose()
    return row.number


@click.command()
@click.option("--port", type=int, default=None, help="Gateway port [default 8400, or a free one near it].")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Run the simulated engines this many times faster than real time.")
@click.option("--policy-source", type=click.Choice(["db", "file"]), default=None,
              help="Where the policy lives [default db, or SWITCHYARD_POLICY_SOURCE]: db lets the console edit, "
                   "publish and roll back (the policy file seeds an empty database); file is the GitOps flow "
                   "(the file is the truth, the console reads it only).")
def demo(port: int | None, time_scale: float, policy_source: str | None) -> None:
    """Start the gateway, the console and a simulated vLLM engine for every pool endpoint.

    Ports already taken (another demo, say) move the gateway and the engines to free ones, recorded in
    the policy; in file mode the file is not rewritten, so busy ports are an error there.
    """
    from switchyard.decide.policy_tests import compile_checked
    from switchyard.policy import PolicyError, read_policy_file

    ctx = cli_context()
    source = policy_source or os.environ.get("SWITCHYARD_POLICY_SOURCE") or "db"
    policy_file = _seed_file(ctx.settings(port=port, policy_source=source))
    settings = ctx.settings(port=port, policy_source=source, policy_file=policy_file)
    stored = _stored_text(settings) if source == "db" else None
    where = f"policy version {stored[1]}" if stored is not None else str(policy_file)
    try:
        text = stored[0] if stored is not None else read_policy_file(policy_file)
        snapshot = compile_checked(text, where)
    except PolicyError as error:
        raise click.ClickException(f"the policy is invalid:\n{error}") from None
    if stored is not None:
        click.echo(f"serving {where} from the database ({policy_file} seeds an empty database only)")
    gateway_fixed = port is not None or "SWITCHYARD_PORT" in os.environ
    step = _free_step(settings, snapshot, gateway_fixed=gateway_fixed, movable=source == "db")
    if step:
        text = _moved_endpoints(text, step)
        snapshot = compile_checked(text, f"{where}, engines moved by {step:+d}")
        number = _publish_moved(settings, text, step)
        if not gateway_fixed:
            settings = ctx.settings(port=settings.port + step, policy_source=source, policy_file=policy_file)
        click.echo(f"the usual ports are taken: this demo uses the gateway port {settings.port} and its engines "
                   f"moved by {step:+d} ports (recorded as policy version {number})")
    endpoints = [urlsplit(u) for p in snapshot.pools.values() for u in p.endpoints]
    control_port = _control_port({settings.port, *(e.port for e in endpoints if e.port)}, SIM_CONTROL_PORT + step)
    if source == "db":  # the engines follow the policy the gateway will serve, which is in the database
        sim_policy = settings.data_dir / "demo-engines.yaml"
        sim_policy.write_text(SIM_POLICY_HEADER + text)
    else:
        sim_policy = policy_file
    key, tier = _demo_key(settings, snapshot)
    console_login = _demo_console_user(settings)

    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(settings.data_dir.resolve()),
           "SWITCHYARD_DATABASE_URL": settings.resolved_database_url, "SWITCHYARD_POLICY_SOURCE": source,
           "SWITCHYARD_POLICY_FILE": str(policy_file.resolve()), "SWITCHYARD_HOST": settings.host,
           "SWITCHYARD_PORT": str(settings.port),
           # A gateway runs in one region: the home of requests that name none (the policy's first).
           "SWITCHYARD_REGION": settings.region or snapshot.document.regions[0]}
    cmd = [sys.executable, "-m", "switchyard"]
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sim = subprocess.Popen([*cmd, "sim", "--policy", str(sim_policy), "--time-scale", str(time_scale),
                                "--control-port", str(control_port)], env=env, start_new_session=True)
        children.append(sim)
        control = f"http://127.0.0.1:{control_port}"
        for e in endpoints:
            _wait_http(f"http://{e.hostname}:{e.port}/health", 60, sim, "the simulated engines")
        _wait_http(f"{control}/health", 60, sim, "the simulated engines' fault control")
        gateway = subprocess.Popen([*cmd, "serve"], env=env, start_new_session=True)
        children.append(gateway)
        base = f"http://{settings.host}:{settings.port}"
        _wait_http(f"{base}/readyz", 60, gateway, "the gateway")
        click.echo(_banner(base, key, tier, snapshot, len(endpoints), env["SWITCHYARD_REGION"], control,
                           console_login))
        while not stopping:
            for child, what in ((sim, "the simulated engines"), (gateway, "the gateway")):
                if child.poll() is not None:
                    raise click.ClickException(f"{what} stopped unexpectedly (exit code {child.returncode})")
            time.sleep(0.3)
        click.echo("stopping…")
    finally:
        _stop(children)
        for s, handler in previous.items():
            signal.signal(s, handler)
    click.echo("stopped.")
