"""The ``switchyard`` command: serve, demo, sim, bench, policy, db, keys, tenants, usage, admin, metrics."""

from __future__ import annotations

from pathlib import Path

import click

from switchyard.cli.context import CliContext


@click.group()
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


def _register() -> None:
    from switchyard.cli import (
        admin_cmds,
        bench_cmd,
        demo_cmd,
        metrics_cmd,
        policy_cmds,
        replay_cmd,
        run_cmds,
        store_cmds,
    )

    main.add_command(run_cmds.serve)
    main.add_command(run_cmds.worker)
    main.add_command(run_cmds.sim)
    main.add_command(demo_cmd.demo)
    main.add_command(policy_cmds.policy)
    policy_cmds.policy.add_command(replay_cmd.replay)
    main.add_command(store_cmds.db)
    main.add_command(store_cmds.keys)
    main.add_command(store_cmds.tenants)
    main.add_command(store_cmds.usage_cmd)
    main.add_command(bench_cmd.bench)
    main.add_command(admin_cmds.admin)
    main.add_command(metrics_cmd.metrics)


_register()
