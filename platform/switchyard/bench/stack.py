"""Switchyard's own processes for ``switchyard bench``: the gateway, simulated engines, the instant
engine and the CLI, started the way a user would start them, and the settings a stack of them shares.

They run as :class:`~switchyard.bench.procs.Processes` children (logs, CPU pinning, stopping).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.bench.procs import Proc, Processes, StartError, free_port, http_post_json, wait_http


def switchyard_command() -> list[str]:
    """How to run the ``switchyard`` CLI of this installation."""
    return [sys.executable, "-m", "switchyard"]


@dataclass(frozen=True, slots=True)
class GatewayHandle:
    """A running ``switchyard serve``."""

    proc: Proc
    base_url: str
    env: dict[str, str]


def state_env(data_dir: Path, policy_file: Path) -> dict[str, str]:
    """The settings every Switchyard process of one bench stack shares (SQLite in ``data_dir``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return {"SWITCHYARD_DATA_DIR": str(data_dir.resolve()),
            "SWITCHYARD_DATABASE_URL": f"sqlite:///{(data_dir / 'switchyard.db').resolve()}",
            "SWITCHYARD_POLICY_FILE": str(policy_file.resolve())}


def run_cli(args: Sequence[str], env: dict[str, str], timeout_s: float = 120.0, input_text: str | None = None) -> str:
    """Run ``switchyard ARGS`` to completion (``input_text`` on its stdin); its stdout.

    Raises:
        StartError: It failed (with its stderr).
    """
    done = subprocess.run([*switchyard_command(), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout_s, check=False, input=input_text)
    if done.returncode != 0:
        raise StartError(f"switchyard {' '.join(args)} failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout


def create_keys(env: dict[str, str], tenants: Sequence[tuple[str, str]]) -> dict[str, str]:
    """A new API key for each ``(tenant, tier)``, in one run of ``switchyard keys create-many`` (the database is
    migrated first): ``{tenant: key}``."""
    lines = "".join(f"{tenant} {tier}\n" for tenant, tier in tenants)
    keys: dict[str, str] = json.loads(run_cli(["keys", "create-many", "--name", "bench"], env, input_text=lines))
    return keys


def create_key(env: dict[str, str], tenant: str, tier: str) -> str:
    """A new API key for ``tenant`` in ``tier`` (the database is migrated first), via the CLI."""
    run_cli(["db", "upgrade"], env)
    return run_cli(["keys", "create", "--tenant", tenant, "--tier", tier, "--name", "bench"], env).strip()


def start_gateway(procs: Processes, name: str, env: dict[str, str], *, port: int | None = None,
                  cpus: Iterable[int] = (), timeout_s: float = 60.0) -> GatewayHandle:
    """Start ``switchyard serve`` with ``env`` (``state_env`` plus settings) and wait for ``/readyz``."""
    port = port or free_port()
    full = {"SWITCHYARD_HOST": "127.0.0.1", "SWITCHYARD_PORT": str(port), "SWITCHYARD_LOG_LEVEL": "warning", **env}
    proc = procs.start(name, [*switchyard_command(), "serve"], env=full, cpus=cpus)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", proc, timeout_s)
    return GatewayHandle(proc, base, full)


def start_sims(procs: Processes, name: str, policy_file: Path, ports: Iterable[int], *, time_scale: float,
               seed: int, regions: Sequence[str] = (), pools: Sequence[str] = (), cpus: Iterable[int] = (),
               timeout_s: float = 60.0, control_port: int | None = None, extra: Sequence[str] = ()) -> Proc:
    """Start ``switchyard sim --policy`` (one process for the selected pools) and wait for every ``/health``.

    With ``control_port``, the process also serves its fault-injection control server on
    ``127.0.0.1:<control_port>`` (``GET/POST /faults``, see :func:`post_faults`), and the start
    waits for it too. ``extra``: more ``switchyard sim`` arguments (``--kv-events-config JSON``).
    """
    cmd = [*switchyard_command(), "sim", "--policy", str(policy_file), "--time-scale", f"{time_scale:g}",
           "--seed", str(seed)]
    for region in regions:
        cmd += ["--region", region]
    for pool in pools:
        cmd += ["--pool", pool]
    if control_port is not None:
        cmd += ["--control-port", str(control_port)]
    cmd += extra
    proc = procs.start(name, cmd, cpus=cpus)
    for port in ports:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s)
    if control_port is not None:
        wait_http(f"http://127.0.0.1:{control_port}/faults", proc, timeout_s)
    return proc


def post_faults(control_port: int, settings: Mapping[str, object], timeout_s: float = 10.0) -> dict[str, Any]:
    """Change the faults of simulated engines through a ``switchyard sim --control-port`` server.

    ``settings`` may name targets (``region``, ``pool``, ``port``; none: every engine of that
    process) and the settings to apply, e.g. ``{"region": "us-east", "mode": "down"}``, or
    ``{"mode": "none"}`` to bring everything back.

    Returns:
        The control server's answer (``{"engines": [...]}``, each engine with its faults).

    Raises:
        OSError: The server could not be reached, or refused the settings (with its answer).
    """
    status, body = http_post_json(f"http://127.0.0.1:{control_port}/faults", json.dumps(dict(settings)).encode(),
                                  timeout_s=timeout_s)
    if status != 200:
        raise OSError(f"POST /faults {dict(settings)} on control port {control_port} answered {status}: "
                      f"{body[:300].decode('utf-8', 'replace')}")
    answer: dict[str, Any] = json.loads(body) if body else {}
    return answer


def start_instant_engine(procs: Processes, name: str, port: int, *, cpus: Iterable[int] = ()) -> Proc:
    """Start the instant engine (``switchyard.bench.instant``) and wait for ``/health``."""
    proc = procs.start(name, [sys.executable, "-m", "switchyard.bench.instant", "--port", str(port)], cpus=cpus)
    wait_http(f"http://127.0.0.1:{port}/health", proc, 30)
    return proc
