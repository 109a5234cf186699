"""``switchyard policy replay``: what a candidate policy would change, before it is published (or what a canary
of it would change: ``--canary``, ``--canary-percent``)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import cast

import click
from sqlalchemy import make_url
from sqlalchemy.exc import OperationalError

from switchyard.bench.spec import Labels, Workload, WorkloadError
from switchyard.bench.traces import azure, mooncake
from switchyard.cli.context import cli_context
from switchyard.decide.pick import STRATEGIES, Strategy
from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyError, PolicySnapshot, read_policy_file
from switchyard.policy.rollout import SLICE_BY, rollout_from_flags
from switchyard.settings import Settings
from switchyard.store import canary as store_canary
from switchyard.store import db as store_db
from switchyard.store.models import PolicyVersion
from switchyard.store.policy_versions import active_version
from switchyard.whatif import CanarySlice, Who, render_report, replay_report
from switchyard.whatif.fleet import FleetError
from switchyard.whatif.logged import log_who, log_workload, read_log

_VERSION = re.compile(r"^v?(\d+)$")


def _stored(settings: Settings, number: int | None) -> PolicySnapshot | None:
    """Version ``number`` (the active one when None) from the database; None when there is none."""
    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        return None  # no embedded database yet: nothing stored (and none is created by looking)
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        if not store_db.is_current(engine):
            return None
        with store_db.session_scope(engine) as session:
            row = active_version(session) if number is None else session.get(PolicyVersion, number)
            if row is None:
                return None
            return compile_checked(row.yaml_text, f"policy version {row.number}", row.number)
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()


def load_policy(ref: str, settings: Settings) -> tuple[PolicySnapshot, Path | None]:
    """A policy named on the command line, and the folder its relative profile paths start from.

    ``active``: the active version in the database, else the policy file. ``vN`` or ``N``: that
    stored version. Anything else: a policy file.

    Raises:
        click.ClickException: The policy does not exist or is invalid (with its YAML location).
    """
    try:
        if ref == "active":
            stored = _stored(settings, None)
            if stored is not None:
                return stored, settings.policy_file.resolve().parent
            path = settings.policy_file
        elif match := _VERSION.match(ref):
            stored = _stored(settings, int(match.group(1)))
            if stored is None:
                raise click.ClickException(f"there is no policy version {match.group(1)} in the database")
            return stored, settings.policy_file.resolve().parent
        else:
            path = Path(ref)
        return compile_checked(read_policy_file(path), str(path)), path.resolve().parent
    except PolicyError as error:
        raise click.ClickException(f"invalid policy {ref}:\n{error}") from None


def _labels(tiers: tuple[str, ...], model: str) -> list[tuple[Labels, float]]:
    """Weighted labels from ``--tier NAME[=WEIGHT]`` options (the tenant label is the tier)."""
    out = []
    for item in tiers:
        name, _, weight = item.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise click.BadParameter(f"{item!r}: the weight after '=' must be a number", param_hint="--tier") from None
        out.append((Labels(tenant=name, request_class=name, model=model), w))
    return out


def _workload(trace: Path, labels: list[tuple[Labels, float]], rate_multiplier: float, duration: float | None,
              limit: int | None, seed: int) -> Workload:
    kind = "azure" if trace.suffix.lower() == ".csv" else "mooncake"
    build = azure if kind == "azure" else mooncake
    try:
        return build(trace, rate_multiplier=rate_multiplier, duration_s=duration, limit=limit, seed=seed,
                     labels=labels)
    except WorkloadError as error:
        raise click.ClickException(str(error)) from None


def running_canary(settings: Settings) -> tuple[PolicySnapshot, CanarySlice]:
    """The running canary in the database: its candidate, and the slice it serves now (its step's percentage,
    salted with its id; the scope's region is this gateway's, ``SWITCHYARD_REGION``).

    Raises:
        click.ClickException: No canary runs (or there is no database), or it cannot be read.
    """
    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        raise click.ClickException("no canary runs: there is no database yet")
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        if not store_db.is_current(engine):
            raise click.ClickException("no canary runs: the database schema is not current (`switchyard db upgrade`)")
        with store_db.session_scope(engine) as session:
            row = store_canary.running(session)
            if row is None:
                raise click.ClickException("no canary runs (start one with `switchyard policy canary start`)")
            version = session.get(PolicyVersion, row.version)
            assert version is not None
            assert row.id is not None
            snapshot = compile_checked(version.yaml_text, f"policy version {version.number}", version.number)
            return snapshot, CanarySlice(store_canary.rollout_of(row), row.percent, row.id, settings.region)
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    except PolicyError as error:
        raise click.ClickException(f"the running canary's candidate is invalid:\n{error}") from None
    finally:
        engine.dispose()


def _log_workload(settings: Settings, since_minutes: float, rate_multiplier: float, duration: float | None,
                  limit: int | None, seed: int, model: str | None) -> tuple[Workload, dict[int, Who]]:
    """The request log's last ``since_minutes`` as a workload (``--duration``, ``--limit`` applied after), and who
    sent each of its requests (by index, as the gateway identified them)."""
    engine = store_db.create_db_engine(settings.resolved_database_url)
    try:
        if not store_db.is_current(engine):
            raise click.ClickException("the database has no request log yet (run `switchyard db upgrade`)")
        with store_db.session_scope(engine) as session:
            entries = read_log(session, window=timedelta(minutes=since_minutes))
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database: {exc.orig}") from None
    finally:
        engine.dispose()
    try:
        workload = log_workload(entries, rate_multiplier=rate_multiplier, seed=seed, default_model=model)
    except WorkloadError as error:
        raise click.ClickException(str(error)) from None
    who = log_who(entries, default_model=model)
    specs = [s for s in workload.specs if duration is None or s.arrival_s < duration][:limit]
    if len(specs) == len(workload.specs):
        return workload, who
    return replace(workload, specs=tuple(specs), duration_s=specs[-1].arrival_s if specs else 0.0), who


def _canary_flags(settings: Settings, percent: float, by: str, tiers: tuple[str, ...], regions: tuple[str, ...],
                  models: tuple[str, ...], salt: int) -> CanarySlice:
    """A canary of ``percent`` from the command line's ``--canary-*`` options."""
    try:
        rollout = rollout_from_flags(percent=percent, by=by, tiers=tiers, regions=regions, models=models)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--canary-percent") from None
    return CanarySlice(rollout, percent, salt, settings.region)


def _default_model(snapshot: PolicySnapshot) -> str:
    """What requests ask for when ``--model`` is not given: the first route, else the first model."""
    doc = snapshot.document
    return doc.routes[0].name if doc.routes else doc.models[0].name


@click.command()
@click.argument("candidate", required=False)
@click.option("--against", default="active", show_default=True,
              help="The policy to compare with: 'active', a version (v7), or a file.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The requests: a Mooncake trace (.jsonl) or an Azure LLM inference trace (.csv).")
@click.option("--from-log", "from_log", is_flag=True,
              help="The requests: the request log in the database (what clients sent; see --since).")
@click.option("--since", "since_minutes", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="With --from-log: the last this-many minutes of the log.")
@click.option("--tier", "tiers", multiple=True, metavar="NAME[=WEIGHT]",
              help="Tier the trace's requests are sent as; repeat for a weighted mix [default: the first tier].")
@click.option("--model", default=None, help="The model the requests ask for [default: the first route, "
                                            "else the first model, of the policy compared with].")
@click.option("--rate-multiplier", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Replay the trace this many times faster.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Only the requests of the first this-many seconds (after the multiplier).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first this-many requests.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and the tier mix.")
@click.option("--picker", type=click.Choice(STRATEGIES), default=None,
              help="Endpoint picking [default: the gateway's setting, SWITCHYARD_PICKER].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write report.md and report.json here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of Markdown.")
@click.option("--canary", "running", is_flag=True,
              help="Replay the running canary (from the database): its candidate decides the requests of its "
                   "slice, at its step's percentage, and the active policy the rest (give no CANDIDATE).")
@click.option("--canary-percent", type=click.FloatRange(min=0, min_open=True, max=100, max_open=True),
              default=None, help="Replay a canary of CANDIDATE: it decides this percentage of the requests (hashed "
                                 "as the gateway hashes them) and the active policy the rest.")
@click.option("--canary-by", type=click.Choice(SLICE_BY), default="tenant", show_default=True,
              help="With --canary-percent: what a request is hashed by to fall in the slice.")
@click.option("--canary-tier", "canary_tiers", multiple=True,
              help="With --canary-percent: only requests of this tier (repeat for more).")
@click.option("--canary-region", "canary_regions", multiple=True,
              help="With --canary-percent: only through gateways of this region (SWITCHYARD_REGION is the "
                   "replay's).")
@click.option("--canary-model", "canary_models", multiple=True,
              help="With --canary-percent: only requests for this model (as the client names it).")
@click.option("--canary-salt", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --canary-percent: the canary id the hash is salted with (each canary takes another slice).")
def replay(candidate: str | None, against: str, trace: Path | None, from_log: bool, since_minutes: float,
           tiers: tuple[str, ...], model: str | None,
           rate_multiplier: float, duration: float | None, limit: int | None, seed: int, picker: str | None,
           out_dir: Path | None, as_json: bool, running: bool, canary_percent: float | None, canary_by: str,
           canary_tiers: tuple[str, ...], canary_regions: tuple[str, ...], canary_models: tuple[str, ...],
           canary_salt: int) -> None:
    """Replay a trace against the active policy (or --against) and CANDIDATE, in simulated time,
    and report what would change: placement, cost per 1,000 requests, refusals per tier, TTFT per
    class and the prefix-cache hit ratio.

    CANDIDATE is a policy file, or a stored version (v7). Both policies' engines are simulated
    from their pools (sim_profile, kv_cache_tokens); nothing is sent anywhere.

    The requests come from a trace (--trace, sent as --tier and --model) or from the request log
    (--from-log: each request's own tier, model, kind and lengths; its text is never logged, so
    prompts are synthetic, sharing a prefix where the engine's prefix cache served one).

    A canary is replayed with --canary (the running one; no CANDIDATE) or --canary-percent (a canary of
    CANDIDATE): the candidate decides the requests of the slice, hashed as the gateway hashes them (a
    logged request by its tenant, key and request id; a trace's by its tier and position) and the other
    policy decides the rest; the report says how many requests the candidate decided.
    """
    settings = cli_context().settings()
    if (trace is None) == (not from_log):
        raise click.UsageError("give exactly one of --trace FILE and --from-log")
    flags_given = bool(canary_by != "tenant" or canary_tiers or canary_regions or canary_models or canary_salt)
    if running and (candidate is not None or canary_percent is not None or flags_given):
        raise click.UsageError("--canary replays the running canary as it runs: give no CANDIDATE and no "
                               "--canary-* option")
    if canary_percent is None and flags_given:
        raise click.UsageError("--canary-by, --canary-tier, --canary-region, --canary-model and --canary-salt "
                               "shape a canary of --canary-percent")
    if candidate is None and not running:
        raise click.UsageError("give a CANDIDATE (a policy file or a version), or --canary")
    base, base_dir = load_policy(against, settings)
    canary: CanarySlice | None = None
    if running:
        cand, canary = running_canary(settings)
        cand_dir: Path | None = settings.policy_file.resolve().parent
    else:
        assert candidate is not None
        cand, cand_dir = load_policy(candidate, settings)
        if canary_percent is not None:
            canary = _canary_flags(settings, canary_percent, canary_by, canary_tiers, canary_regions, canary_models,
                                   canary_salt)
    if trace is not None:
        labels = _labels(tiers or (base.document.tiers[0].name,), model or _default_model(base))
        workload = _workload(trace, labels, rate_multiplier, duration, limit, seed)
        what = str(trace)
        who: dict[int, Who] = {}
    else:
        if tiers:
            raise click.UsageError("--tier applies to --trace: a logged request keeps its own tier")
        workload, who = _log_workload(settings, since_minutes, rate_multiplier, duration, limit, seed, model)
        what = f"the request log of the last {since_minutes:g} minutes"
    if not workload.specs:
        raise click.ClickException(f"{what}: no requests to replay (check --duration and --limit)")
    strategy = cast(Strategy, picker or settings.picker)  # click.Choice checked it
    try:
        report = replay_report(base, cand, workload, active_dir=base_dir, candidate_dir=cand_dir,
                               strategy=strategy, seed=seed, canary=canary, who=who)
    except FleetError as error:
        raise click.ClickException(f"cannot simulate the policy's engines: {error}") from None
    markdown = render_report(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.md").write_text(markdown, encoding="utf-8")
        (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    click.echo(json.dumps(report, indent=1) if as_json else markdown)
