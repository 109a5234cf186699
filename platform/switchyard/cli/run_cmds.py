"""``switchyard serve``, ``switchyard worker`` and ``switchyard sim`` (the long-running processes),
``switchyard sim calibrate``, and
``switchyard sim fault`` / ``faults`` (a running sim process's fault control server)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

from switchyard.cli.context import cli_context

if TYPE_CHECKING:
    from litestar import Litestar

    from switchyard.policy import PolicySnapshot
    from switchyard.settings import Settings
    from switchyard.sim import EngineConfig

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _prepared_app(settings: Settings) -> Litestar:
    """The gateway app for ``settings`` with logging set up, its database migrated and its policy loaded."""
    from sqlalchemy.exc import OperationalError

    from switchyard.app import create_app
    from switchyard.logs import configure
    from switchyard.policy import PolicyError

    configure(settings.log_level, settings.log_format)
    if settings.log_level != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)
    app = create_app(settings)
    try:
        app.state.runtime.prepare()
    except PolicyError as error:
        raise click.ClickException("no valid policy to serve:\n" + str(error)) from None
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    return app


@click.command()
@click.option("--host", default=None, help="Listen address [env SWITCHYARD_HOST; default 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Listen port [env SWITCHYARD_PORT; default 8400].")
@click.option("--policy-source", type=click.Choice(["file", "db"]), default=None,
              help="Where the policy's truth is [env SWITCHYARD_POLICY_SOURCE; default file].")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Gateway processes on the one port, sharing the database and Redis (SWITCHYARD_REDIS_URL is "
                   "then required) [env SWITCHYARD_WORKERS; default 1].")
def serve(host: str | None, port: int | None, policy_source: str | None, workers: int | None) -> None:
    """Run the gateway (OpenAI-compatible API, console at /admin, /metrics)."""
    import uvicorn

    from switchyard.gateway.server import protocol_factory

    context = cli_context()
    settings = context.settings(host=host, port=port, policy_source=policy_source, workers=workers)
    if settings.workers > 1 and not settings.redis_url:
        raise click.ClickException(f"--workers {settings.workers} needs SWITCHYARD_REDIS_URL: limits, reservations "
                                   "and caches must be shared by the processes, not counted in each")
    app = _prepared_app(settings)  # migrates, checks the policy and makes the console secret, once
    # httptools with the limits on what a client controls (head size, slow heads and bodies: gateway.server).
    options: dict[str, Any] = {"host": settings.host, "port": settings.port, "log_level": settings.log_level,
                               "access_log": False, "loop": "uvloop", "http": protocol_factory(settings),
                               "lifespan": "on", "timeout_keep_alive": settings.client_keepalive_timeout_s,
                               "timeout_graceful_shutdown": 10,
                               "server_header": False,  # (what serves is nobody's business; one header less)
                               "log_config": None}  # the handlers of switchyard.logs.configure
    if settings.workers == 1:
        uvicorn.run(app, **options)
        return
    # Each worker process builds its own app from the environment: the command line's choices go there.
    given = {"SWITCHYARD_DATA_DIR": context.data_dir, "SWITCHYARD_DATABASE_URL": context.database_url,
             "SWITCHYARD_POLICY_FILE": context.policy_file, "SWITCHYARD_HOST": host, "SWITCHYARD_PORT": port,
             "SWITCHYARD_POLICY_SOURCE": policy_source}
    os.environ.update({name: str(value) for name, value in given.items() if value is not None})
    os.environ["SWITCHYARD_WORKERS"] = "1"  # a worker is one process
    uvicorn.run("switchyard.cli.run_cmds:worker_app", factory=True, workers=settings.workers, **options)


def worker_app() -> Litestar:
    """The app of one ``switchyard serve --workers N`` process (settings from the environment)."""
    from switchyard.settings import Settings

    return _prepared_app(Settings())


@click.command()
@click.option("--concurrency", type=int, default=None,
              help="Batch lines kept in flight [env SWITCHYARD_BATCH_CONCURRENCY; default: every pool's "
              "sequence slots and batch waiting room, from the policy].")
def worker(concurrency: int | None) -> None:
    """Run a dedicated batch worker: the gateway's request path without its HTTP server.

    Claims lines of batch jobs from the database (every gateway process also runs one unless
    SWITCHYARD_BATCH_WORKER=false), dispatches them through the batch lane, records each result once.
    SIGTERM or Ctrl-C hands the lines it holds back at once.
    """
    import asyncio
    import signal

    overrides: dict[str, Any] = {"batch_worker": True}
    if concurrency is not None:
        overrides["batch_concurrency"] = concurrency
    app = _prepared_app(cli_context().settings(**overrides))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with app.lifespan():
            click.echo("batch worker running; Ctrl-C stops it", err=True)
            await stop.wait()

    asyncio.run(run())


def engines_for_policy(snapshot: PolicySnapshot, regions: tuple[str, ...] = (), pools: tuple[str, ...] = (),
                       time_scale: float = 1.0, seed: int = 0, base_dir: Path | None = None) -> list[EngineConfig]:
    """One simulated engine per loopback endpoint of the policy's pools (optionally filtered).

    A pool's ``sim_profile`` is a profile name or the path of a profile file; a relative path is
    taken from ``base_dir`` (the policy file's folder), not from the working directory. The engines of a
    pool that declares ``kv_events`` publish their KV-cache events where it says (bound, as vLLM binds
    ``tcp://*:PORT``), so that gateways on the same policy find them.
    """
    from dataclasses import replace

    from switchyard.kvcache.config import KVEventsConfig
    from switchyard.whatif.fleet import pool_engine_config

    configs: list[EngineConfig] = []
    for pool in snapshot.pools.values():
        if (regions and pool.region not in regions) or (pools and pool.name not in pools):
            continue
        for url in pool.endpoints:
            parts = urlsplit(url)
            if parts.hostname not in LOOPBACK or parts.port is None:
                raise click.ClickException(
                    f"pool {pool.name}: {url} is not a loopback address with a port; the simulator "
                    "only serves 127.0.0.1/localhost endpoints")
            config = pool_engine_config(snapshot, pool, port=parts.port, host=parts.hostname,
                                        time_scale=time_scale, seed=seed, base_dir=base_dir)
            if pool.kv_events is not None:
                events, replay = pool.kv_events.addresses(url)
                bound = events if events.startswith("ipc://") else "tcp://*:" + events.rsplit(":", 1)[1]
                config = replace(config, kv_events=KVEventsConfig(
                    enable_kv_cache_events=True, publisher="zmq", endpoint=bound, replay_endpoint=replay,
                    topic=pool.kv_events.topic))
            configs.append(config)
    if not configs:
        raise click.ClickException("no pool matches the given --region/--pool filters")
    return configs


@click.group(invoke_without_command=True)
@click.option("--policy", "policy_path", type=click.Path(path_type=Path), default=None,
              help="Simulate every endpoint of this policy's pools.")
@click.option("--region", "regions", multiple=True, help="With --policy: only pools of this region.")
@click.option("--pool", "pools", multiple=True, help="With --policy: only this pool.")
@click.option("--model", "served_model", help="Served model name of a single engine.")
@click.option("--port", type=int, help="Port of a single engine.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--profile", default="h100-8b", show_default=True,
              help="Hardware profile: a built-in name or the path of a profile file (.json/.yaml).")
@click.option("--kv-cache-tokens", type=int, default=None, help="KV-cache capacity (tokens).")
@click.option("--max-model-len", type=int, default=None, help="Context window (tokens).")
@click.option("--max-num-seqs", type=int, default=None, help="Most sequences running at once.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Simulated seconds per wall-clock second (10 = ten times faster).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--control-port", type=int, default=None,
              help="Also run the fault control server on this port (see `switchyard sim fault`).")
@click.option("--control-host", default="127.0.0.1", show_default=True, help="Listen address of the control server.")
@click.option("--kv-events-config", "kv_events_config", default=None, metavar="JSON",
              help="Publish KV-cache events as vLLM does (its --kv-events-config JSON: enable_kv_cache_events, "
                   "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic). The Nth engine "
                   "of the process (from 0, in the order the start-up lines list them) publishes on both "
                   "endpoints offset by N, as vLLM's data-parallel ranks: a tcp port plus N, an ipc:// or "
                   "inproc:// name plus _dpN. As in vLLM, an endpoint with * or :: and any ipc:// one is "
                   "bound; tcp://HOST:PORT is connected to (the subscriber binds it). Machine-local: "
                   "ipc:///tmp/kv (subscribers connect), replay tcp://127.0.0.1:PORT.")
@click.option("--enable-lora", is_flag=True, help="Serve LoRA adapters (vLLM's --enable-lora): a request whose "
              "model names a registered adapter runs on the base model with it.")
@click.option("--max-loras", type=int, default=None, help="With --enable-lora: most distinct adapters in one batch "
              "(and GPU adapter slots; vLLM's default 1).")
@click.option("--max-cpu-loras", type=int, default=None, help="With --enable-lora: adapters kept in the CPU cache "
              "(default: --max-loras).")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH",
              help="An adapter registered at start-up, as NAME=PATH or vLLM's JSON form; repeat for each.")
@click.option("--allow-runtime-lora", is_flag=True, default=None,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: as vLLM, when "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING is 1 or true).")
@click.pass_context
def sim(ctx: click.Context, policy_path: Path | None, regions: tuple[str, ...], pools: tuple[str, ...],
        served_model: str | None, port: int | None, host: str, profile: str, kv_cache_tokens: int | None,
        max_model_len: int | None, max_num_seqs: int | None, time_scale: float, seed: int,
        control_port: int | None, control_host: str, kv_events_config: str | None, enable_lora: bool,
        max_loras: int | None, max_cpu_loras: int | None, lora_modules: tuple[str, ...],
        allow_runtime_lora: bool | None) -> None:
    """Run simulated vLLM engines: one (--model, --port) or all of a policy's (--policy).

    With --control-port, a control server sets the faults of any of them by region, pool or port
    (`switchyard sim fault --control URL ...`, `switchyard sim faults --control URL`).
    `switchyard sim calibrate --url URL --out FILE` measures a real engine instead and writes a
    profile that --profile loads.
    """
    if ctx.invoked_subcommand is not None:
        return
    from switchyard.policy import PolicyError, compile_policy, read_policy_file
    from switchyard.sim import ControlAddress, EngineConfig, run_engines

    if control_port is not None and not 0 <= control_port <= 65535:
        raise click.BadParameter(f"{control_port} is not a valid TCP port", param_hint="--control-port")

    lora_flags = enable_lora or max_loras is not None or max_cpu_loras is not None or lora_modules
    if policy_path is not None:
        if served_model or port:
            raise click.UsageError("give either --policy or --model/--port, not both")
        if lora_flags or allow_runtime_lora:
            raise click.UsageError("with --policy the pools say how LoRA is served (max_loras, "
                                   "runtime_lora_loading, models' adapter_of); the LoRA flags are for one engine")
        try:
            snapshot = compile_policy(read_policy_file(policy_path), str(policy_path))
        except PolicyError as error:
            raise click.ClickException(f"invalid policy:\n{error}") from None
        configs = engines_for_policy(snapshot, regions, pools, time_scale, seed,
                                     base_dir=policy_path.resolve().parent)
    else:
        if not served_model or not port:
            raise click.UsageError("give --model and --port (or --policy FILE)")
        from switchyard.sim.lora import parse_lora_modules

        try:
            modules = parse_lora_modules(lora_modules)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--lora-modules") from None
        configs = [EngineConfig(served_model=served_model, port=port, host=host, profile=profile,
                                kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, time_scale=time_scale, seed=seed,
                                enable_lora=enable_lora, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                lora_modules=modules, allow_runtime_lora=allow_runtime_lora)]
    if kv_events_config is not None:
        configs = _with_kv_events(configs, kv_events_config)
    control = ControlAddress(control_host, control_port) if control_port is not None else None
    run_engines(configs, control)  # bad configuration or a port in use exits with one line saying what is wrong


def _with_kv_events(configs: list[EngineConfig], text: str) -> list[EngineConfig]:
    """Each engine's KV events config: the JSON's endpoints offset by the engine's index."""
    from switchyard.sim.config import with_kv_events

    try:
        return with_kv_events(configs, text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-events-config") from None


_CONTROL = click.option("--control", "control", required=True, metavar="URL",
                        help="The sim process's control server (`switchyard sim --control-port N`: http://127.0.0.1:N).")


@sim.command("fault")
@_CONTROL
@click.option("--region", default=None, help="Only the engines of this region.")
@click.option("--pool", default=None, help="Only the engines of this pool.")
@click.option("--port", type=int, default=None, help="Only the engine on this port.")
@click.option("--mode", type=click.Choice(["none", "slow", "drip", "hang", "down", "unavailable", "invalid_json",
                                          "truncate", "wrong_type", "huge"]), default=None,
              help="down: connection refused; unavailable: 503 everywhere; hang: the engine stalls (no step, no "
                   "byte, /health fine); drip: one step per --drip-interval-s; slow: slower steps; "
                   "invalid_json, truncate, wrong_type, huge: 200 answers that are garbage.")
@click.option("--slow-factor", type=float, default=None, help="Step-time multiplier in mode slow.")
@click.option("--drip-interval-s", type=float, default=None, help="Wall-clock seconds between steps in mode drip.")
@click.option("--error-rate", type=float, default=None, help="Fraction of inference requests answered 500.")
@click.option("--throttle-rate", type=float, default=None, help="Fraction answered 429 (Retry-After: 1).")
@click.option("--overload-rate", type=float, default=None, help="Fraction answered 503 (Retry-After: 1).")
@click.option("--abort-rate", type=float, default=None, help="Fraction whose answer is broken off mid-way.")
@click.option("--abort-after-tokens", type=int, default=None, help="Content tokens a broken-off stream gets first.")
@click.option("--abort-with", type=click.Choice(["close", "error"]), default=None,
              help="How a broken-off stream ends: close (the connection drops) or error (vLLM's mid-stream error "
                   "event, then [DONE]).")
@click.option("--clear", is_flag=True, help="Back to healthy: mode none, every rate 0, default factor and tokens.")
def sim_fault(control: str, region: str | None, pool: str | None, port: int | None, clear: bool,
              **settings: Any) -> None:
    """Set faults on the engines of a running `switchyard sim` (all of them, or those the targets pick).

    Prints one line per engine changed. Example: `switchyard sim fault --control http://127.0.0.1:8390
    --region eu-west --mode down`, then `... --region eu-west --clear`.
    """
    from switchyard.sim.fault_client import ControlError, describe, set_faults
    from switchyard.sim.faults import DEFAULTS

    given = {key: value for key, value in settings.items() if value is not None}
    if clear and given:
        raise click.UsageError("--clear resets every setting; give it without --mode or any rate")
    if not clear and not given:
        raise click.UsageError("nothing to change: give --mode, a rate, --slow-factor, --drip-interval-s, "
                               "--abort-after-tokens, --abort-with or --clear (`switchyard sim faults --control URL` "
                               "lists the engines)")
    targets = {key: value for key, value in (("region", region), ("pool", pool), ("port", port))
               if value is not None}
    try:
        engines = set_faults(control, {**targets, **(dict(DEFAULTS) if clear else given)})
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    for engine in engines:
        click.echo(describe(engine))


@sim.command("faults")
@_CONTROL
def sim_faults(control: str) -> None:
    """List the engines of a running `switchyard sim` and their fault settings, one line each."""
    from switchyard.sim.fault_client import ControlError, describe, list_faults

    try:
        engines = list_faults(control)
    except ControlError as exc:
        raise click.ClickException(str(exc)) from None
    for engine in engines:
        click.echo(describe(engine))


@sim.command("calibrate")
@click.option("--url", required=True, help="Base URL of the engine to measure (vLLM or anything that speaks its API).")
@click.option("--model", "served_model", default=None,
              help="Served model to measure [default: the first /v1/models lists].")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Profile file to write (.json, or .yaml/.yml).")
@click.option("--report", "report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a Markdown report here.")
@click.option("--quick", is_flag=True,
              help="Fewer, shorter measurements and a shorter replay (about a minute on a CPU).")
@click.option("--no-compare", "no_compare", is_flag=True,
              help="Skip replaying a workload against the engine and a simulator with the fitted profile.")
@click.option("--name", default=None, help="Profile name [default: the --out file name without its suffix].")
@click.option("--hardware", default=None, help="Description of the measured hardware, kept in the profile.")
@click.option("--max-num-seqs", type=int, default=None,
              help="The engine's --max-num-seqs, when the measurements cannot reach it.")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="The engine's --max-num-batched-tokens (not visible to a client) [default: 2048].")
@click.option("--replay-requests", type=int, default=None, help="Requests in the comparison's replay.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and the replayed workload.")
def calibrate(url: str, served_model: str | None, out: Path, report: Path | None, quick: bool, no_compare: bool,
              name: str | None, hardware: str | None, max_num_seqs: int | None, max_num_batched_tokens: int | None,
              replay_requests: int | None, seed: int) -> None:
    """Measure a real engine and write a hardware profile the simulator can load.

    Measures TTFT against prompt length, the prefix-cache speed-up and inter-token latency against
    batch size on an otherwise idle engine, fits the simulator's step-time model, writes the profile,
    then (unless --no-compare) replays one short workload against the engine and against a simulator
    running the new profile and reports TTFT and ITL percentiles side by side.
    """
    import asyncio

    from switchyard.sim.calibrate import CalibrationOptions, EngineError, render_report
    from switchyard.sim.calibrate import calibrate as run_calibration

    for flag, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--replay-requests", replay_requests)):
        if value is not None and value < 1:
            raise click.BadParameter("must be at least 1", param_hint=flag)
    for flag, path in (("--out", out), ("--report", report)):
        if path is not None and not path.resolve().parent.is_dir():
            raise click.BadParameter(f"folder {path.parent} does not exist", param_hint=flag)
    options = CalibrationOptions(url=url, out=out, model=served_model, report=report, quick=quick,
                                 compare=not no_compare, name=name, hardware=hardware, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, replay_requests=replay_requests,
                                 seed=seed)
    try:
        result = asyncio.run(run_calibration(options, lambda line: click.echo(line, err=True)))
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    text = render_report(result)
    if report is not None:
        report.write_text(text, encoding="utf-8")
        click.echo(f"calibrate: report written to {report}", err=True)
    click.echo(text)
