"""``switchyard serve`` and ``switchyard sim``: the long-running processes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import click
from sqlalchemy.exc import OperationalError

from switchyard.cli.context import cli_context
from switchyard.policy import PolicyError, PolicySnapshot, compile_policy, read_policy_file

if TYPE_CHECKING:
    from switchyard.sim import EngineConfig

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@click.command()
@click.option("--host", default=None, help="Listen address [env SWITCHYARD_HOST; default 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Listen port [env SWITCHYARD_PORT; default 8400].")
@click.option("--policy-source", type=click.Choice(["file", "db"]), default=None,
              help="Where the policy's truth is [env SWITCHYARD_POLICY_SOURCE; default file].")
def serve(host: str | None, port: int | None, policy_source: str | None) -> None:
    """Run the gateway (OpenAI-compatible API, console at /admin, /metrics)."""
    import uvicorn

    from switchyard.gateway.app import create_app

    settings = cli_context().settings(host=host, port=port, policy_source=policy_source)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)
    app = create_app(settings)
    try:
        app.state.runtime.prepare()
    except PolicyError as error:
        raise click.ClickException("no valid policy to serve:\n" + str(error)) from None
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                loop="uvloop", http="httptools", lifespan="on", timeout_graceful_shutdown=10)


def engines_for_policy(snapshot: PolicySnapshot, regions: tuple[str, ...] = (), pools: tuple[str, ...] = (),
                       time_scale: float = 1.0, seed: int = 0) -> list[EngineConfig]:
    """One simulated engine per loopback endpoint of the policy's pools (optionally filtered)."""
    from switchyard.sim import EngineConfig

    configs: list[EngineConfig] = []
    for pool in snapshot.pools.values():
        if (regions and pool.region not in regions) or (pools and pool.name not in pools):
            continue
        context = max((m.context_window for m in snapshot.models.values() if pool.name in m.pools), default=None)
        for url in pool.endpoints:
            parts = urlsplit(url)
            if parts.hostname not in LOOPBACK or parts.port is None:
                raise click.ClickException(
                    f"pool {pool.name}: {url} is not a loopback address with a port; the simulator "
                    "only serves 127.0.0.1/localhost endpoints")
            configs.append(EngineConfig(served_model=pool.served_model, port=parts.port, host=parts.hostname,
                                        profile=pool.sim_profile, kv_cache_tokens=pool.kv_cache_tokens,
                                        max_model_len=context, time_scale=time_scale, seed=seed))
    if not configs:
        raise click.ClickException("no pool matches the given --region/--pool filters")
    return configs


@click.command()
@click.option("--policy", "policy_path", type=click.Path(path_type=Path), default=None,
              help="Simulate every endpoint of this policy's pools.")
@click.option("--region", "regions", multiple=True, help="With --policy: only pools of this region.")
@click.option("--pool", "pools", multiple=True, help="With --policy: only this pool.")
@click.option("--model", "served_model", help="Served model name of a single engine.")
@click.option("--port", type=int, help="Port of a single engine.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--profile", default="h100-8b", show_default=True, help="Hardware profile.")
@click.option("--kv-cache-tokens", type=int, default=None, help="KV-cache capacity (tokens).")
@click.option("--max-model-len", type=int, default=None, help="Context window (tokens).")
@click.option("--max-num-seqs", type=int, default=None, help="Most sequences running at once.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Simulated seconds per wall-clock second (10 = ten times faster).")
@click.option("--seed", type=int, default=0, show_default=True)
def sim(policy_path: Path | None, regions: tuple[str, ...], pools: tuple[str, ...], served_model: str | None,
        port: int | None, host: str, profile: str, kv_cache_tokens: int | None, max_model_len: int | None,
        max_num_seqs: int | None, time_scale: float, seed: int) -> None:
    """Run simulated vLLM engines: one (--model, --port) or all of a policy's (--policy)."""
    from switchyard.sim import EngineConfig, run_engines

    if policy_path is not None:
        if served_model or port:
            raise click.UsageError("give either --policy or --model/--port, not both")
        try:
            snapshot = compile_policy(read_policy_file(policy_path), str(policy_path))
        except PolicyError as error:
            raise click.ClickException(f"invalid policy:\n{error}") from None
        configs = engines_for_policy(snapshot, regions, pools, time_scale, seed)
    else:
        if not served_model or not port:
            raise click.UsageError("give --model and --port (or --policy FILE)")
        configs = [EngineConfig(served_model=served_model, port=port, host=host, profile=profile,
                                kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, time_scale=time_scale, seed=seed)]
    run_engines(configs)  # bad configuration exits with one line saying what is wrong
