"""``switchyard bench``: measure the gateway against baselines on this machine, and write a report."""

from __future__ import annotations

import importlib.util
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import click

#: Exit status when a scenario could not run to the end (a missed goal is not a failure).
EXIT_SCENARIO_FAILED = 1
EXIT_INTERRUPTED = 130
#: What the bench needs beyond the gateway: the ``bench`` extra (``pip install 'switchyard[bench]'``).
BENCH_EXTRA = ("numpy", "matplotlib", "tqdm")


def _require_bench_extra() -> None:
    """Refuse to start without the bench extra: the plots would fail only after the whole run."""
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"switchyard bench needs {', '.join(missing)}, which the bench extra installs: "
                                   "pip install 'switchyard[bench]'")


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@click.command()
@click.argument("names", nargs=-1, metavar="[SCENARIO]...")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help="A scenario to run (repeatable; the same as naming it as an argument): overhead, prefix, failover "
                   "(alias chaos), overload, reload, auto, cache, batch, soak, canary, adapters [default: overhead "
                   "prefix failover auto].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Report folder [default: ./reports/bench-YYYYmmdd-HHMMSS].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds every workload and simulated engine.")
@click.option("--quick", is_flag=True, help="A few seconds per arm (smoke test); figures are indicative only.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Mooncake trace (JSONL with hash_ids) for the prefix scenario "
                   "[default: the Mooncake conversation trace shipped with switchyard].")
@click.option("--rate-multiplier", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Replay the trace this many times faster [prefix default: 12].")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Simulated seconds per wall-clock second of the simulated engines [scenario defaults].")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per arm (per step in the overhead scenario; the whole run in soak) [scenario defaults].")
@click.option("--workload", type=click.Choice(["mooncake", "agents"]), default=None,
              help="The prefix scenario's workload: the Mooncake trace or agent sessions [default: both; with "
                   "--quick, mooncake].")
@click.option("--no-litellm", is_flag=True, help="Do not install or measure the LiteLLM arm of the overhead scenario.")
@click.option("--profile", "profile", is_flag=True,
              help="Also record a py-spy profile of the gateway under saturation (overhead scenario).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def bench(names: tuple[str, ...], scenarios: tuple[str, ...], out_dir: Path | None, seed: int, quick: bool,
          trace: Path | None, rate_multiplier: float | None, time_scale: float | None, duration_s: float | None,
          workload: str | None, no_litellm: bool, profile: bool, no_progress: bool) -> None:
    """Measure Switchyard against baselines, side by side, with real processes on loopback.

    Scenarios are named as arguments or with --scenario (``switchyard bench soak --duration 1800``).

    Starts the gateway, simulated engines and baselines as processes on 127.0.0.1, drives an
    open-loop load, and writes report.md, report.json and PNG plots. Exits 1 if a scenario could
    not run to the end; a missed goal is reported, not an error.
    """
    _require_bench_extra()
    from switchyard.bench.runner import run_bench
    from switchyard.bench.scenarios import DEFAULT_SCENARIOS, SCENARIOS, BenchOptions

    asked = names + scenarios
    unknown = [s for s in asked if s not in SCENARIOS]
    if unknown:
        raise click.BadParameter(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}",
                                 param_hint="--scenario")
    chosen = list(dict.fromkeys(asked)) or list(DEFAULT_SCENARIOS)
    out = out_dir or Path("reports") / time.strftime("bench-%Y%m%d-%H%M%S")
    options = BenchOptions(out_dir=out, seed=seed, quick=quick, trace=trace, rate_multiplier=rate_multiplier,
                           time_scale=time_scale, duration_s=duration_s, litellm=not no_litellm, profile=profile,
                           progress=not no_progress, workload=workload)

    began = time.monotonic()

    def say(line: str) -> None:
        click.echo(f"bench [{time.monotonic() - began:6.1f} s] {line}", err=True)

    # Ctrl-C and SIGTERM stop the run and every process it started, even where the shell that
    # started the bench left SIGINT ignored (a background job).
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        run = run_bench(options, chosen, say)
    except KeyboardInterrupt:
        click.echo("bench: interrupted; every process it started is stopped", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    click.echo(f"report: {out / 'report.md'}")
    for outcome in run.outcomes:
        click.echo(f"  {outcome.name}: {outcome.status}" + (f" ({outcome.summary})" if outcome.summary else "")
                   + (f": {outcome.error}" if outcome.error else ""))
    if run.failed:
        sys.exit(EXIT_SCENARIO_FAILED)
