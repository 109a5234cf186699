"""The ``switchyard`` command: serve, demo, sim, bench, policy, db, keys, tenants, usage, admin, metrics.

Owns: the command line. Each command lives in a module of this package that is imported only when the
command runs (:class:`~switchyard.cli.lazy.LazyGroup`), and those modules import what the command needs
(the gateway, the store, the bench) inside the command, so that ``switchyard --help`` and
``switchyard <group> --help`` start in a fraction of a second. Must not touch: what the commands call;
this package only parses arguments, calls it and prints the outcome.
"""

from __future__ import annotations

from pathlib import Path

import click

from switchyard.cli.context import CliContext
from switchyard.cli.lazy import LazyCommand, LazyGroup

#: Every top-level command: where it lives and its short help (``tests/unit/cli/test_lazy.py`` keeps these
#: equal to the commands' docstrings).
COMMANDS: dict[str, LazyCommand] = {
    "admin": LazyCommand("switchyard.cli.admin_cmds:admin",
                         "Console users: create them, list them, change their role or password, disable them."),
    "bench": LazyCommand("switchyard.cli.bench_cmd:bench",
                         "Measure Switchyard against baselines, side by side, with real processes on loopback."),
    "db": LazyCommand("switchyard.cli.database:db",
                      "The database schema (Alembic migrations; SQLite or PostgreSQL)."),
    "demo": LazyCommand("switchyard.cli.demo_cmd:demo",
                        "Start the gateway, the console and a simulated vLLM engine for every pool endpoint."),
    "keys": LazyCommand("switchyard.cli.key_cmds:keys",
                        "API keys (stored hashed; a key is shown once, when it is created)."),
    "metrics": LazyCommand("switchyard.cli.metrics_cmd:metrics",
                           "Print every metric the gateway exports: name as scraped, type, labels, meaning, "
                           "label values."),
    "policy": LazyCommand("switchyard.cli.policy_cmds:policy",
                          "Check, describe, publish, roll back, compare and export policy documents."),
    "serve": LazyCommand("switchyard.cli.run_cmds:serve",
                         "Run the gateway (OpenAI-compatible API, console at /admin, /metrics)."),
    "sim": LazyCommand("switchyard.cli.run_cmds:sim",
                       "Run simulated vLLM engines: one (--model, --port) or all of a policy's (--policy)."),
    "tenants": LazyCommand("switchyard.cli.tenant_cmds:tenants", "Tenants and their tiers."),
    "usage": LazyCommand("switchyard.cli.usage_cmd:usage_cmd",
                         "The usage ledger: requests, tokens and spend per UTC day, tenant, key and model."),
    "worker": LazyCommand("switchyard.cli.run_cmds:worker",
                          "Run a dedicated batch worker: the gateway's request path without its HTTP server."),
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="switchyard")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Where embedded state lives [env SWITCHYARD_DATA_DIR; default .switchyard].")
@click.option("--database-url", default=None,
              help="SQLAlchemy URL [env SWITCHYARD_DATABASE_URL; default SQLite in the data dir].")
@click.option("--policy-file", type=click.Path(path_type=Path), default=None,
              help="The policy document [env SWITCHYARD_POLICY_FILE; default policies.yaml].")
@click.pass_context
def main(ctx: click.Context, data_dir: Path | None, database_url: str | None, policy_file: Path | None) -> None:
    """Switchyard: the control layer in front of vLLM."""
    ctx.obj = CliContext(data_dir=data_dir, database_url=database_url, policy_file=policy_file)
