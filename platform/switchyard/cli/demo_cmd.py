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


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


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
            secret, _record = create_key(session, DEMO_TENANT, f"demo {time.strftime('%Y-%m-%d %H:%M:%S')}")
    finally:
        engine.dispose()
    return secret, tier


def _demo_console_user(settings: Settings) -> str:
    """A console admin for the demo (made with a random password the first time), as a banner line."""
    from switchyard.store import db as store_db
    from switchyard.store.admin_users import create_user, list_users

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


def _control_port(taken: set[int]) -> int:
    """``SIM_CONTROL_PORT``, or the first port below it that the gateway and the policy leave alone."""
    port = SIM_CONTROL_PORT
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


@click.command()
@click.option("--port", type=int, default=None, help="Gateway port [default 8400].")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Run the simulated engines this many times faster than real time.")
def demo(port: int | None, time_scale: float) -> None:
    """Start the gateway, the console and a simulated vLLM engine for every pool endpoint."""
    from switchyard.decide.policy_tests import compile_checked
    from switchyard.policy import PolicyError, read_policy_file

    ctx = cli_context()
    settings = ctx.settings(port=port)
    policy_file = settings.policy_file
    if not policy_file.exists():
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        policy_file = settings.data_dir / "policies.yaml"
        shutil.copyfile(demo_policy(), policy_file)
        click.echo(f"no {settings.policy_file} here; using the demo policy, copied to {policy_file}")
        settings = ctx.settings(port=port, policy_file=policy_file)
    try:
        snapshot = compile_checked(read_policy_file(policy_file), str(policy_file))
    except PolicyError as error:
        raise click.ClickException(f"the policy is invalid:\n{error}") from None
    endpoints = [urlsplit(u) for p in snapshot.pools.values() for u in p.endpoints]
    busy = [f"{settings.host}:{settings.port} (gateway)"] if not _port_free(settings.host, settings.port) else []
    busy += [f"{e.hostname}:{e.port}" for e in endpoints if e.port and not _port_free(e.hostname or "", e.port)]
    control_port = _control_port({settings.port, *(e.port for e in endpoints if e.port)})
    if not _port_free("127.0.0.1", control_port):
        busy.append(f"127.0.0.1:{control_port} (simulator fault control)")
    if busy:
        raise click.ClickException("ports already in use: " + ", ".join(busy)
                                   + " (another demo running? stop it, or change --port / the policy)")
    key, tier = _demo_key(settings, snapshot)
    console_login = _demo_console_user(settings)

    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(settings.data_dir.resolve()),
           "SWITCHYARD_DATABASE_URL": settings.resolved_database_url,
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
        sim = subprocess.Popen([*cmd, "sim", "--policy", str(policy_file), "--time-scale", str(time_scale),
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
