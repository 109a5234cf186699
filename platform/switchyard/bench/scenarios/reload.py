"""``reload``: policy publishes and rollbacks under load, on two gateway replicas sharing a database.

Two gateway processes (``policy_source=db``) share one database: SQLite in the run's folder by
default (replicas learn of a publish by polling), or the PostgreSQL of ``SWITCHYARD_DATABASE_URL``
when it names one (LISTEN/NOTIFY, with polling as the safety net). A steady open-loop Poisson load
of short chat requests goes to both replicas while ``publishes`` changes alternate through replica
A's admin API: a new document, then a rollback to the first version, and so on — each one a new
version.

Figures: **propagation time** to replica B (from the version's commit to the moment B serves
it, read from B's own activation record) and A's own switch; **failed requests** (anything but
200); **mis-versioned requests**: a response whose ``x-switchyard-route`` names a version that
was not active on the replica that served it at any moment between the request's send and its
end. Goals: every publish reaches the other replica within 1 s; zero failed and zero mis-versioned
requests.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp

from switchyard.bench.loadgen import LoadStarts, run_open_loop
from switchyard.bench.policies import TENANT, TIER, replicas_policy
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.sender import Target
from switchyard.bench.stack import GatewayHandle, create_key, start_gateway, start_sims, state_env
from switchyard.bench.stats import percentiles
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import goal, ms, num, table, text

RATE = 120.0
DURATION_S = 30.0
QUICK_DURATION_S = 6.0
PUBLISHES = 50
QUICK_PUBLISHES = 10
TIME_SCALE = 10.0
REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
MODEL = "chat"
GOAL_PROPAGATION_S = 1.0
#: Slack when comparing timestamps of two processes on one machine (clock reads, rounding).
CLOCK_SLACK_S = 0.002


@dataclass
class Publish:
    """One publish or rollback through replica A."""

    kind: str  # publish | rollback
    version: int
    committed_at: float  # the version row's created_at, as time.time()
    sent_at: float
    answered_at: float


@dataclass
class Replica:
    """One gateway replica and every activation it reported."""

    name: str
    handle: GatewayHandle
    activations: dict[tuple[int | None, float], str] = field(default_factory=dict)

    def ordered(self) -> list[tuple[float, int | None]]:
        """``(time, version)`` of each switch, oldest first."""
        return sorted((at, version) for version, at in self.activations)

    def first_at(self, version: int) -> float | None:
        """When this replica first served ``version`` or a later one."""
        return next((at for at, v in self.ordered() if v is not None and v >= version), None)

    def active_during(self, version: int | None, start: float, end: float) -> bool:
        """Whether ``version`` was active here at some moment of ``[start, end]``."""
        switches = self.ordered()
        for i, (at, v) in enumerate(switches):
            until = switches[i + 1][0] if i + 1 < len(switches) else float("inf")
            if v == version and at <= end + CLOCK_SLACK_S and until >= start - CLOCK_SLACK_S:
                return True
        return False


async def _ready(session: aiohttp.ClientSession, replica: Replica) -> dict[str, Any]:
    async with session.get(f"{replica.handle.base_url}/readyz") as response:
        policy: dict[str, Any] = (await response.json())["checks"]["policy"]
    for a in policy["activations"]:
        replica.activations[(a["version"], float(a["at"]))] = a["via"]
    return policy


def _version_number(label: str | None) -> int | None:
    return int(label[1:]) if label and label.startswith("v") and label[1:].isdigit() else None


class Reload:
    """The reload scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.publishes = QUICK_PUBLISHES if opts.quick else PUBLISHES
        self.time_scale = opts.time_scale or TIME_SCALE
        self.token = secrets.token_urlsafe(24)
        self.database = os.environ.get("SWITCHYARD_DATABASE_URL", "")
        self.results: dict[str, list[Result]] = {}
        self.starts: dict[str, float] = {}  # replica name -> its load's start, as time.time()
        self.log: list[Publish] = []
        self.replicas: list[Replica] = []
        self.errors: list[str] = []

    @property
    def backend(self) -> str:
        return "postgresql" if self.database.startswith("postgresql") else "sqlite"

    def run(self) -> None:
        ctx = self.ctx
        ports = free_ports(REPLICAS)
        policy = ctx.state_dir / "policies.yaml"
        self.text_a = replicas_policy(ports, model=MODEL, served_model=SERVED, profile=PROFILE,
                                      kv_cache_tokens=100_000, context_window=8192)
        self.text_b = self.text_a.replace("max_queue_ms: 2000", "max_queue_ms: 2001")
        assert self.text_b != self.text_a
        policy.write_text(self.text_a)
        env = state_env(ctx.state_dir / "switchyard", policy)
        if self.backend == "postgresql":
            env["SWITCHYARD_DATABASE_URL"] = self.database
        env |= {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_ADMIN_TOKEN": self.token}
        ctx.say(f"reload: two gateway replicas on {self.backend}, {REPLICAS} simulated engines")
        start_sims(ctx.procs, "reload-sims", policy, ports, time_scale=self.time_scale, seed=ctx.options.seed)
        key = create_key(env, TENANT, TIER)
        self.replicas = [Replica(name, start_gateway(ctx.procs, f"reload-gateway-{name}", env))
                         for name in ("A", "B")]
        mix = [RequestTemplate(tenant=TENANT, model=MODEL, prompt_tokens=(50, 200), output_tokens=(4, 16),
                               stream=False)]
        workloads = {r.name: poisson(RATE / REPLICAS, self.duration_s, mix, ctx.options.seed + i)
                     for i, r in enumerate(self.replicas)}
        self.workloads = workloads
        ctx.say(f"reload: {sum(len(w) for w in workloads.values())} requests over {self.duration_s:.0f} s, "
                f"{self.publishes} publishes and rollbacks")
        asyncio.run(self._drive(key))
        if self.errors:
            raise RuntimeError("the publishes could not be staged: " + "; ".join(self.errors))

    async def _drive(self, key: str) -> None:
        starts = LoadStarts(self.starts)
        async with aiohttp.ClientSession() as session:
            for replica in self.replicas:
                await _ready(session, replica)
            changes = asyncio.create_task(self._changes(session, starts.began))
            try:
                loads = [run_open_loop(self.workloads[r.name], Target(r.handle.base_url, f"replica {r.name}",
                                                                      default_api_key=key),
                                       progress=self.ctx.options.progress and r.name == "A", timeout_s=30.0,
                                       on_start=starts.recorder(r.name))
                         for r in self.replicas]
                results = await asyncio.gather(*loads)
            finally:
                try:
                    await changes
                except Exception as exc:  # reported with the figures the run could still make
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            for replica in self.replicas:
                await _ready(session, replica)
        self.results = {f"replica {r.name}": rs for r, rs in zip(self.replicas, results, strict=True)}

    async def _changes(self, session: aiohttp.ClientSession, began: asyncio.Event) -> None:
        """Alternate publishes of document B and rollbacks to v1 through replica A, evenly spread."""
        await began.wait()
        a, b = self.replicas
        window = 0.8 * self.duration_s
        gap = window / self.publishes
        started = time.monotonic()
        headers = {"Authorization": f"Bearer {self.token}"}
        for i in range(self.publishes):
            await asyncio.sleep(max(0.0, started + 0.1 * self.duration_s + i * gap - time.monotonic()))
            kind = "publish" if i % 2 == 0 else "rollback"
            body = ({"yaml": self.text_b, "message": f"bench reload {i}", "author": "bench"} if kind == "publish"
                    else {"version": 1, "message": f"bench rollback {i}", "author": "bench"})
            url = f"{a.handle.base_url}/admin/api/policy/{'versions' if kind == 'publish' else 'rollback'}"
            sent = time.time()
            async with session.post(url, json=body, headers=headers) as response:
                data = await response.json()
                if response.status != 201:
                    raise RuntimeError(f"{kind} {i} answered {response.status}: {data}")
            answered = time.time()
            version = int(data["version"]["number"])
            committed = datetime.fromisoformat(data["version"]["created_at"]).timestamp()
            self.log.append(Publish(kind, version, committed, sent, answered))
            deadline = time.monotonic() + 10.0
            for replica in (a, b):  # until each serves it (or a later one), reading its activations
                while _version_number((await _ready(session, replica))["version"]) != version:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {replica.name} did not serve v{version} within 10 s")
                    await asyncio.sleep(0.005)

    def wall(self, result: Result) -> tuple[float, float]:
        """A result's send and end, as time.time()."""
        wall_start = self.starts[result.arm.removeprefix("replica ")]
        return wall_start + result.sent_s, wall_start + (result.done_s if result.done_s is not None
                                                         else result.sent_s)


def analyse(run: Reload) -> dict[str, Any]:
    """Propagation times, failures and version consistency."""
    a, b = run.replicas
    to_b = [at - p.committed_at for p in run.log if (at := b.first_at(p.version)) is not None]
    at_a = [at - p.committed_at for p in run.log if (at := a.first_at(p.version)) is not None]
    answered = [p.answered_at - p.sent_at for p in run.log]
    failed = mis = 0
    kinds: set[str] = set()
    by_name = {r.name: r for r in run.replicas}
    for arm, results in run.results.items():
        replica = by_name[arm.removeprefix("replica ")]
        for r in results:
            if not r.ok:
                failed += 1
                kinds.add(f"{r.status or '-'} {r.error_type or ''}".strip())
                continue
            start, end = run.wall(r)
            if not replica.active_during(_version_number(r.route_fields.get("policy")), start, end):
                mis += 1
    total = sum(len(rs) for rs in run.results.values())
    return {"to_b": to_b, "at_a": at_a, "answered": answered, "failed": failed, "misversioned": mis,
            "requests": total, "failure_kinds": sorted(kinds), "published": len(run.log),
            "missed_b": sum(1 for p in run.log if b.first_at(p.version) is None)}


def _dist(name: str, values: Sequence[float], note: str) -> dict[str, Any]:
    p = percentiles(values, (50, 90, 99))
    return {"what": name, "n": len(values), "p50_s": p["p50"], "p90_s": p["p90"], "p99_s": p["p99"],
            "max_s": max(values) if values else None, "note": note}


def run(ctx: ScenarioContext) -> Outcome:
    """Run the reload scenario and write its report into ``ctx.out_dir``."""
    r = Reload(ctx)
    started = time.monotonic()
    r.run()
    a = analyse(r)
    mechanism = ("LISTEN/NOTIFY, polling every 0.5 s as the safety net" if r.backend == "postgresql"
                 else "polling every 0.5 s (SQLite has no notifications)")
    propagation = table(
        "Propagation of a publish",
        [text("what", "what"), num("n", "publishes", 0), ms("p50_s", "p50 ms", 1), ms("p90_s", "p90 ms", 1),
         ms("p99_s", "p99 ms", 1), ms("max_s", "max ms", 1), text("note", "note")],
        [_dist("to replica B", a["to_b"], f"commit → B serves it; via {mechanism}"),
         _dist("replica A (the one published through)", a["at_a"], "commit → A serves it"),
         _dist("admin API call", a["answered"], "publish or rollback request → its answer (validation, "
                                                "policy tests, commit, switch)")],
        f"{a['published']} changes alternating a publish and a rollback to v1; database: {r.backend}.")
    worst = max(a["to_b"]) if a["to_b"] else None
    goals = [
        goal("every publish served by the other replica", f"≤ {GOAL_PROPAGATION_S:g} s", worst,
             None if worst is None else worst <= GOAL_PROPAGATION_S and a["missed_b"] == 0, unit="s", decimals=3,
             note=f"worst of {len(a['to_b'])}; via {mechanism}"),
        goal("failed requests during reloads", "0", a["failed"], a["failed"] == 0, decimals=0,
             note=f"of {a['requests']}" + (f": {', '.join(a['failure_kinds'])}" if a["failure_kinds"] else "")),
        goal("mis-versioned requests", "0", a["misversioned"], a["misversioned"] == 0, decimals=0,
             note="route header names a version not active on its replica during the request"),
    ]
    notes = [f"{RATE:g} requests/s split over two replicas, {r.publishes} changes over {0.8 * r.duration_s:.0f} s; "
             f"{REPLICAS} `{PROFILE}` engines at time scale {r.time_scale:g}."]
    if r.backend == "sqlite":
        notes.append("Set SWITCHYARD_DATABASE_URL to a PostgreSQL database to measure LISTEN/NOTIFY propagation.")
    parameters = {"scenario": "reload", "rate": RATE, "duration_s": r.duration_s, "publishes": r.publishes,
                  "database": r.backend, "time_scale": r.time_scale, "wall_s": time.monotonic() - started}
    report = build_report(r.results, title="switchyard bench: reload (policy lifecycle)",
                          parameters=parameters, seeds={"workload": ctx.options.seed}, tables=[propagation],
                          goals=goals, notes=notes)
    write_report(report, ctx.out_dir)
    summary = (f"{a['published']} changes; to the other replica p99 "
               f"{1000 * (percentiles(a['to_b'], (99,))['p99'] or 0):.0f} ms ({r.backend}); "
               f"{a['failed']} failed, {a['misversioned']} mis-versioned of {a['requests']} requests")
    return Outcome("reload", "ok", summary, goals, [propagation], "reload/report.md", notes=notes)
