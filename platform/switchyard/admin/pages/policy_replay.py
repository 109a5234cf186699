"""Console: the policy editor's pre-publish replay ("What this change would do").

The candidate-check view (``admin/partials/_policy_validation.html.j2``) shows this panel above the
publish button and loads it with htmx once the view has rendered, so the check itself stays fast.
The panel posts the candidate (with the CSRF token, as every console form does) to
``/admin/policy/replay``, which compiles it through the same gate as a publish, reads the request
log of the chosen window and replays it through the serving policy and the candidate in simulated
time (:func:`switchyard.whatif.replay_report`, what ``switchyard policy replay --from-log`` runs).

The panel can also replay a canary (``replay_as``): a canary of the candidate on a share of the requests
(hashed by ``replay_by``, as the gateway hashes them; the log knows each request's tenant, key and id), or the
running canary (its candidate, slice and id, read from the database; the posted candidate is then not
replayed). The candidate decides the requests of the slice and the serving policy the rest; the panel says how
many the candidate decided and shows the slice's own figures.

The replay is CPU-bound (up to a few seconds for :data:`MAX_LOG_ENTRIES` entries): it runs in a
worker process (``anyio.to_process``: the policies travel as their texts, the log as plain entries),
one replay at a time per gateway process, so it never holds the gateway's interpreter lock while
requests are served. Running it
needs the operator role, like every other console POST that is not a plain read of one request; it
writes nothing.

Owns: the route, the window choices and turning the report's plain data into table rows. Must not
touch: the replay itself (``whatif``) or the policy store.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_process
import anyio.to_thread
from litestar import post
from litestar.di import NamedDependency
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Template
from sqlalchemy import Engine

from switchyard.admin.common import in_db
from switchyard.admin.pages.policy_edit import CANDIDATE, text_of
from switchyard.decide.pick import Strategy
from switchyard.decide.policy_tests import compile_checked
from switchyard.figures import DASH, fixed, percent
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy import PolicyError, PolicySnapshot, compile_policy
from switchyard.policy.rollout import SLICE_BY, Rollout, rollout_from_flags
from switchyard.settings import Settings
from switchyard.store import canary as canary_store
from switchyard.store.models import PolicyVersion

if TYPE_CHECKING:
    from sqlmodel import Session

    from switchyard.whatif.logged import LogEntry

PANEL = "admin/partials/_policy_replay.html.j2"
PAGE = "admin/policy_replay.html.j2"
#: Log entries replayed at most (the newest are kept): bounds the replay to a few seconds.
MAX_LOG_ENTRIES = 20_000
#: Placement moves listed one by one (the report may list more; the rest are summed).
TOP_MOVES = 10
MINUS = "\u2212"


@dataclass(frozen=True, slots=True)
class Window:
    """A stretch of the request log the panel can replay."""

    span: timedelta
    label: str  # as the selector says it: "last hour"

    @property
    def phrase(self) -> str:
        """As a sentence says it: "the last hour"."""
        return f"the {self.label}"


WINDOWS: dict[str, Window] = {
    "15m": Window(timedelta(minutes=15), "last 15 minutes"),
    "1h": Window(timedelta(hours=1), "last hour"),
    "24h": Window(timedelta(hours=24), "last 24 hours"),
}
DEFAULT_WINDOW = "1h"

#: The shares of the requests a canary of the candidate can be replayed on (``replay_as``, in percent).
CANARY_PERCENTS = ("1", "5", "10", "25", "50")
#: ``replay_as``: every request (the default), a canary of one of :data:`CANARY_PERCENTS`, or the running canary.
EVERY, RUNNING = "all", "running"


@dataclass(frozen=True, slots=True)
class Running:
    """The running canary, as the panel offers it: its id, candidate version (and text), slice and step."""

    id: int
    version: int
    text: str
    rollout: Rollout
    percent: float

    @property
    def label(self) -> str:
        return f"v{self.version} on {self.percent:g}% by {self.rollout.by}"


#: Why the log's entries could not be replayed (``log_workload``'s ``skipped`` keys).
SKIP_REASONS = {
    "no_tier": "no tier (the API key was refused)",
    "no_prompt_count": "no prompt count (refused before the body was read)",
    "no_model": "no model named",
    "not_generation": "an embedding or a tokenizer call (the replay simulates generation only)",
}
#: Workload keys the "where the requests came from" list shows; the rest go under "more".
SHOWN_WORKLOAD_KEYS = {"source", "entries", "skipped", "refused_in_log", "first", "last", "requests", "duration_s"}


# --- formatting -------------------------------------------------------------------------------------

def _count(value: int | None) -> str:
    return fixed(value, decimals=0, grouped=True, missing=DASH)


def _ms(seconds: float | None) -> str:
    return fixed(seconds, scale=1000, decimals=1, unit=" ms", grouped=True, missing=DASH)


def _seconds(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.2f} s"


def _cost(value: float | None) -> str:
    return fixed(value, decimals=4, missing=DASH)


def _signed(value: float, fmt: str) -> str:
    return ("+" if value > 0 else MINUS) + format(abs(value), fmt)


def _count_change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return DASH
    return "same" if a == b else _signed(b - a, ",")


def _relative_change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return DASH
    if a == b:
        return "same"
    if a == 0:
        return "new"
    percent = 100 * (b - a) / a
    return "same" if abs(percent) < 0.05 else _signed(percent, ".1f") + "%"


def cell(value: Any) -> str:
    """Any report value as a table cell (for rows and keys the panel does not know by name)."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {cell(v)}" for k, v in value.items()) or DASH
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value) or DASH
    return str(value)


def _heading(key: str) -> str:
    return key.replace("_", " ").strip().capitalize()


def _columns(rows: list[dict[str, Any]], known: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The known columns, then any key the rows carry that the panel does not know (in their order)."""
    named = {key for key, _ in known}
    extra: dict[str, str] = {}
    for row in rows:
        extra |= {key: key.replace("_", " ") for key in row if key not in named and key not in extra}
    return [(k, h) for k, h in known if any(k in row for row in rows)] + list(extra.items())


# --- the report as the panel shows it ------------------------------------------------------------------

#: The arm figures the panel names, in the order it shows them; any other number an arm carries follows,
#: named after its key ("refused" is requests less served).
FIGURES: dict[str, str] = {
    "served": "served", "refused": "refused or failed", "cost_per_1000": "cost per 1,000 requests",
    "prefix_cache_hit_ratio": "prefix-cache hit ratio (prompt tokens)", "ttft_p50_s": "TTFT p50",
    "ttft_p99_s": "TTFT p99", "shed": "shed (503)", "queued": "queued", "queue_wait_p99_s": "queue wait p99",
    "downgraded": "downgraded", "cache_hits": "response-cache hits",
    "response_cache_hit_ratio": "response-cache hit ratio", "prompt_tokens": "prompt tokens (served)",
    "cached_tokens": "prompt tokens from the prefix cache", "output_tokens": "output tokens",
}
#: The figures of the first table; the others follow in a second one.
HEADLINE = ("served", "refused", "cost_per_1000", "prefix_cache_hit_ratio", "ttft_p50_s", "ttft_p99_s")
#: Arm keys that are no figure to compare (or are shown elsewhere: the times under the workload).
NOT_FIGURES = {"name", "policy", "sha256", "requests", "cost", "simulated_s", "wall_s", "speedup"}
#: (title, first column) of the tables made of an arm's mappings (``statuses``, ``codes``, ...).
ARM_TABLES = {"statuses": ("Statuses", "Status"), "codes": ("Refusal and error codes", "Code")}
REFUSAL_COLUMNS = [("tier", "tier"), ("class", "class"), ("requests", "requests"),
                   ("active_429", "429 active"), ("candidate_429", "429 candidate"),
                   ("active_503", "503 active"), ("candidate_503", "503 candidate"),
                   ("active_other", "other active"), ("candidate_other", "other candidate")]
TTFT_COLUMNS = [("class", "class"), ("active_served", "served active"), ("candidate_served", "served candidate"),
                ("active_p50", "p50 active"), ("candidate_p50", "p50 candidate"),
                ("active_p99", "p99 active"), ("candidate_p99", "p99 candidate")]


def _figure(key: str, a: Any, b: Any) -> tuple[str, str, str]:
    """(active, candidate, change) of one figure, formatted by what its key says it is."""
    if key.endswith("_ratio"):
        return percent(a, missing=DASH), percent(b, missing=DASH), _relative_change(a, b)
    if key.endswith("_s"):
        return _ms(a), _ms(b), _relative_change(a, b)
    if key.startswith("cost"):
        return _cost(a), _cost(b), _relative_change(a, b)
    if all(isinstance(v, int) or v is None for v in (a, b)):
        return _count(a), _count(b), _count_change(a, b)
    return cell(a), cell(b), _relative_change(a, b)


def _when(value: Any) -> str | None:
    """An ISO time of the workload as the panel says it (to the second, UTC)."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return value


def _is_figure(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _headline(active: dict[str, Any], candidate: dict[str, Any]) -> list[dict[str, str]]:
    """One row per figure of the arms: the known ones in :data:`FIGURES` order, then any other number."""
    values = {"refused": tuple(arm.get("requests", 0) - arm.get("served", 0) for arm in (active, candidate))}
    for key in dict.fromkeys([*active, *candidate]):
        a, b = active.get(key), candidate.get(key)
        if key not in NOT_FIGURES and _is_figure(a) and _is_figure(b):
            values[key] = (a, b)
    order = [k for k in FIGURES if k in values] + [k for k in values if k not in FIGURES]
    rows = []
    for key in order:
        shown = _figure(key, *values[key])
        rows.append({"key": key, "figure": FIGURES.get(key, key.replace("_", " ")), "active": shown[0],
                     "candidate": shown[1], "change": shown[2]})
    return rows


def _arm_tables(active: dict[str, Any], candidate: dict[str, Any]) -> list[dict[str, Any]]:
    """A table per mapping the arms carry (statuses, refusal codes, ...): each value under both policies."""
    tables = []
    for key in dict.fromkeys([*active, *candidate]):
        a, b = active.get(key), candidate.get(key)
        if not isinstance(a, dict) or not isinstance(b, dict) or not (a or b):
            continue
        names = sorted(set(a) | set(b), key=str)
        title, column = ARM_TABLES.get(key, (_heading(key), "Value"))
        tables.append({"key": key, "title": title, "column": column,
                       "rows": [(str(n), cell(a.get(n, 0)), cell(b.get(n, 0))) for n in names]})
    return tables


def _table(rows: list[dict[str, Any]], known: list[tuple[str, str]],
           formats: dict[str, Any] | None = None) -> dict[str, Any]:
    columns = _columns(rows, known)
    formats = formats or {}
    return {"columns": [h for _, h in columns],
            "rows": [{"key": row.get(columns[0][0]) if columns else None,
                      "cells": [(formats.get(k, cell)(row.get(k)), isinstance(row.get(k), int | float))
                                for k, _ in columns]}
                     for row in rows]}


def skipped_entries(workload: dict[str, Any]) -> list[tuple[str, int]]:
    """(why, how many) for the log entries the workload could not replay."""
    skipped = workload.get("skipped") or {}
    return [(SKIP_REASONS.get(k, k.replace("_", " ")), v) for k, v in skipped.items() if v]


def _source(workload: dict[str, Any], active: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    more = {_heading(k): cell(v) for k, v in workload.items() if k not in SHOWN_WORKLOAD_KEYS}
    return {
        "entries": workload.get("entries", 0),
        "requests": workload.get("requests", 0),
        "skipped": skipped_entries(workload),
        "refused_in_log": workload.get("refused_in_log"),
        "first": _when(workload.get("first")), "last": _when(workload.get("last")),
        "span": _seconds(workload.get("duration_s")),
        "simulated": [_seconds(arm.get("simulated_s")) for arm in (active, candidate)],
        "wall": [_seconds(arm.get("wall_s")) for arm in (active, candidate)],
        "more": more,
    }


def _canary_view(canary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's ``canary`` as the panel says it: who decided how many, and the slice's own headline."""
    if canary is None:
        return None
    only = canary.get("only") or {}
    sliced = canary.get("slice") or {}
    arms = sliced.get("arms") or [{}, {}]
    return {**canary, "share_text": percent(canary.get("share"), missing=DASH),
            "scope": "; ".join(f"{k} {', '.join(v)}" for k, v in only.items() if v) or "every request",
            "headline": [row for row in _headline(arms[0], arms[1]) if row["key"] in HEADLINE]
            if canary.get("candidate_decided") else [],
            "changes": sliced.get("changes") or {}}


def report_view(report: dict[str, Any]) -> dict[str, Any]:
    """The replay's report (:func:`switchyard.whatif.report.compare_arms`'s data) as the panel's rows."""
    active, candidate = report["arms"][0], report["arms"][1]
    changes = report.get("changes") or {}
    moves = list(changes.get("moves") or [])
    figures = _headline(active, candidate)
    shown, rest = moves[:TOP_MOVES], moves[TOP_MOVES:]
    return {
        "active": active, "candidate": candidate,
        "headline": [row for row in figures if row["key"] in HEADLINE],
        "figures": [row for row in figures if row["key"] not in HEADLINE],
        "changes": changes,
        "moves": shown,
        "other_moves": (changes.get("other_moves") or 0) + sum(m.get("requests", 0) for m in rest),
        "refusals": _table(list(report.get("refusals") or []), REFUSAL_COLUMNS),
        "ttft": _table(list(report.get("ttft") or []), TTFT_COLUMNS,
                       dict.fromkeys(("active_p50", "candidate_p50", "active_p99", "candidate_p99"), _ms)),
        "arm_tables": _arm_tables(active, candidate),
        "not_modelled": list(report.get("not_modelled") or []),
        "source": _source(report.get("workload") or {}, active, candidate),
        "canary": _canary_view(report.get("canary")),
    }


# --- the replay -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Replayed:
    """What one replay found: the report, or why there is none."""

    report: dict[str, Any] | None  # None: the log had nothing to replay
    workload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CanaryOrder:
    """A canary to replay, as it travels to the worker: its rollout (JSON), step percentage, id and the gateway's
    region."""

    rollout: str
    percent: float
    salt: int
    region: str | None


def _replay(active: tuple[str, int | None], candidate: tuple[str, int | None], entries: list[LogEntry],
            folder: Path, picker: Strategy, canary: CanaryOrder | None = None) -> Replayed:
    """Build the workload and replay it through both policies, given as (text, version) (blocking: run in a
    worker process; both were validated by the caller); with ``canary``, the candidate decides its slice only."""
    # Imported here, in the worker: the gateway must not load the simulator, bench or numpy to start.
    from switchyard.whatif import CanarySlice, replay_report
    from switchyard.whatif.logged import log_who, log_workload

    workload = log_workload(entries)
    if not workload.specs:
        return Replayed(None, workload.describe())
    sliced = None
    if canary is not None:
        sliced = CanarySlice(Rollout.model_validate_json(canary.rollout), canary.percent, canary.salt, canary.region)
    report = replay_report(compile_policy(active[0], "active", active[1]),
                           compile_policy(candidate[0], CANDIDATE, candidate[1]), workload, active_dir=folder,
                           candidate_dir=folder, strategy=picker, canary=sliced, who=log_who(entries))
    return Replayed(report, report["workload"])


def _read_log(session: Session, span: timedelta) -> list[LogEntry]:
    """The newest log entries of the window, one more than are replayed (on the database's worker thread,
    which is also where ``whatif`` is first imported: not at the gateway's start, not on its event loop)."""
    from switchyard.whatif.logged import read_log

    return read_log(session, window=span, limit=MAX_LOG_ENTRIES + 1)


def _window_of(value: Any) -> tuple[str, Window] | None:
    key = value if isinstance(value, str) and value else DEFAULT_WINDOW
    return (key, WINDOWS[key]) if key in WINDOWS else None


def _read_running(session: Session) -> Running | None:
    row = canary_store.running(session)
    if row is None:
        return None
    version = session.get(PolicyVersion, row.version)
    assert row.id is not None
    assert version is not None
    return Running(row.id, row.version, version.yaml_text, canary_store.rollout_of(row), row.percent)


def _as_of(form: Any, running: Running | None) -> tuple[str, str] | None:
    """(``replay_as``, ``replay_by``) of the form, or None when either is not one the panel offers."""
    as_key = form.get("replay_as") or EVERY
    by = form.get("replay_by") or "tenant"
    if as_key not in (EVERY, *CANARY_PERCENTS, *((RUNNING,) if running is not None else ())) or by not in SLICE_BY:
        return None
    return as_key, by


def _respond(request: HTMXRequest, text: str, context: dict[str, Any]) -> Template:
    context = {"windows": WINDOWS, "window_key": DEFAULT_WINDOW, "window": WINDOWS[DEFAULT_WINDOW],
               "max_entries": MAX_LOG_ENTRIES, "message": None, "view": None, "unseen": [],
               "canary_percents": CANARY_PERCENTS, "slice_by": SLICE_BY, "as_key": EVERY, "by_key": "tenant",
               "running": None} | context
    if request.htmx:
        return HTMXTemplate(template_name=PANEL, context=context)
    return Template(template_name=PAGE, context=context | {"text": text})


@post("/policy/replay", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def policy_replay(request: HTMXRequest, settings: NamedDependency[Settings], db: NamedDependency[Engine],
                        policy: NamedDependency[PolicyHolder],
                        replay_limiter: NamedDependency[anyio.CapacityLimiter]) -> Template:
    """Replay the request log through the serving policy and the posted candidate (or a canary of it, or the
    running canary); the panel (htmx) or a page. Every outcome is a 200 with the panel saying what happened
    (htmx swaps only 2xx answers). ``replay_limiter`` runs one replay at a time in this process."""
    active = policy.snapshot  # read once: the whole comparison is against one version
    form = await request.form()
    text = text_of(form)
    running = await in_db(db, _read_running)
    chosen = _window_of(form.get("replay_window"))
    as_of = _as_of(form, running)
    if chosen is None or as_of is None:
        what = "windows of the request log" if chosen is None else "ways to replay the candidate"
        return _respond(request, text, {"message": f"Choose one of the offered {what}.", "alert": True,
                                        "running": running})
    key, window = chosen
    as_key, by = as_of
    base = {"window_key": key, "window": window, "as_key": as_key, "by_key": by, "running": running}
    canary: CanaryOrder | None = None
    candidate_ref: tuple[str, int | None] = (text, None)
    if as_key == RUNNING:
        assert running is not None
        candidate_ref = (running.text, running.version)
        canary = CanaryOrder(running.rollout.model_dump_json(), running.percent, running.id, settings.region)
    elif as_key != EVERY:
        rollout = rollout_from_flags(percent=float(as_key), by=by)
        canary = CanaryOrder(rollout.model_dump_json(), float(as_key), 0, settings.region)
    try:
        candidate = await anyio.to_thread.run_sync(compile_checked, candidate_ref[0], CANDIDATE, candidate_ref[1])
    except PolicyError as error:
        count = len(error.issues)
        return _respond(request, text, base | {
            "alert": True, "message": f"The candidate is not valid ({count} issue{'s' if count != 1 else ''}), "
                                      "so it was not replayed: fix it first."})
    entries = await in_db(db, lambda session: _read_log(session, window.span))
    capped = len(entries) > MAX_LOG_ENTRIES
    entries = entries[-MAX_LOG_ENTRIES:]  # oldest first: keep the newest
    folder = settings.policy_file.resolve().parent  # where relative sim_profile paths start, as the CLI does
    from switchyard.whatif.fleet import FleetError  # loaded by _read_log already

    try:
        replayed = await anyio.to_process.run_sync(_replay, (active.text, active.version), candidate_ref, entries,
                                                   folder, settings.picker, canary, limiter=replay_limiter)
    except FleetError as error:
        return _respond(request, text, base | {
            "alert": True, "message": f"The replay cannot simulate the policies' engines: {error}. "
                                      "Publishing is still possible."})
    context: dict[str, Any] = base | {"capped": capped, "workload": replayed.workload,
                                      "skipped": skipped_entries(replayed.workload),
                                      "request_log_on": settings.request_log,
                                      "sample_rate": settings.request_log_sample_rate}
    if replayed.report is not None:
        context["view"] = report_view(replayed.report)
        context["unseen"] = unseen_by_the_log(active, candidate, entries)
    return _respond(request, text, context)


def touched(active: PolicySnapshot, candidate: PolicySnapshot) -> tuple[list[str], list[str]]:
    """The tiers, and the models and routes, that the candidate adds, removes or changes."""
    def changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
        return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))

    def by_name(items: Any) -> dict[str, Any]:
        return {item.name: item.model_dump(mode="json") for item in items}

    tiers = changed(by_name(active.document.tiers), by_name(candidate.document.tiers))
    models = changed(by_name(active.document.models) | by_name(active.document.routes),
                     by_name(candidate.document.models) | by_name(candidate.document.routes))
    return tiers, models


def unseen_by_the_log(active: PolicySnapshot, candidate: PolicySnapshot, entries: list[LogEntry]) -> list[str]:
    """What the change touches that no replayed request reached, one phrase each: the replay cannot show what
    the change does there. A model counts as reached when a request asked for it or for a route that can
    choose it (in either version)."""
    tiers, models = touched(active, candidate)
    asked_tiers = {e.tier for e in entries}
    asked = {e.model for e in entries if e.model is not None}
    reached = set(asked)
    for snapshot in (active, candidate):
        for name in asked & set(snapshot.routes):
            route = snapshot.routes[name]
            reached |= {rule.model for rule in route.rules} | {route.default}
    return ([f"tier {t}" for t in tiers if t not in asked_tiers]
            + [f"{'route' if m in active.routes or m in candidate.routes else 'model'} {m}"
               for m in models if m not in reached])


ROUTES: list[Any] = [policy_replay]
