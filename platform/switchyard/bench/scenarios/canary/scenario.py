"""The ``canary`` scenario's run: engines, two gateway replicas sharing a database, many tenants, the steady load,
and the two canaries started and watched under it through the admin API (what the registry calls is :func:`run`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp

from switchyard.bench.loadgen import LoadStarts, run_open_loop
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.canary.figures import analyse, goals_of, notes_of, summary_of, tables_of
from switchyard.bench.scenarios.canary.policy import (
    BAD_CHANGE,
    GOOD_CHANGE,
    LARGE_ENGINES,
    ROUTE,
    SMALL_ENGINES,
    bad_candidate,
    base_policy,
    good_candidate,
    tenants,
)
from switchyard.bench.sender import Target
from switchyard.bench.stack import GatewayHandle, create_keys, run_cli, start_gateway, start_sims, state_env
from switchyard.bench.synthetic import RequestTemplate, poisson

NAME = "canary"
#: Requests per second over both replicas (open loop, Poisson), and tenants sharing them evenly.
RATE, QUICK_RATE = 120.0, 80.0
TENANTS, QUICK_TENANTS = 200, 100
TIME_SCALE = 10.0
REPLICAS = 2
#: Seconds of load before the first canary, between the two, and after the second.
WARMUP_S, QUICK_WARMUP_S = 5.0, 3.0
SETTLE_S, QUICK_SETTLE_S = 4.0, 2.0
TAIL_S, QUICK_TAIL_S = 4.0, 2.0
#: A canary still running after this long is aborted (and its goal missed).
GOOD_TIMEOUT_S, QUICK_GOOD_TIMEOUT_S = 150.0, 60.0
BAD_TIMEOUT_S, QUICK_BAD_TIMEOUT_S = 180.0, 90.0
POLL_S = 0.25
REQUEST_TIMEOUT_S = 30.0
#: The guards compare the slice with the rest once each side has ``min_requests`` in the window (per class for a
#: class's test), and a step passes only once its slice has served as many. At ``alpha`` 0.001 (the default, shared
#: among the ten to twenty tests of an evaluation) the bad candidate here (TTFT p99 and cost about twice the rest's)
#: is rejected on 60 to 90 slice requests, which a first step of 1% (one tenant of 200, 0.6 requests/s) cannot
#: gather within two minutes: it passes the first step on too little evidence to reject it, and the 10% step (25-30
#: times the traffic) rejects it within seconds. The share it decides is then its first step's requests plus those
#: seconds', over everything sent meanwhile: 40 keeps the first step at about 70 s, so that share stays near 1% and
#: the rollback within the two minutes. ``--quick`` keeps 20, the least a rollout allows (a shorter first step).
MIN_REQUESTS, QUICK_MIN_REQUESTS = 40, 20
#: The sliding window: longer than the first step takes to gather ``min_requests`` in its slice, so the guards
#: have seen the whole step before it can pass.
WINDOW_S = 120.0
GOOD_STEPS = ((5.0, 15.0), (25.0, 15.0), (50.0, 15.0))
QUICK_GOOD_STEPS = ((5.0, 4.0), (25.0, 4.0), (50.0, 4.0))
BAD_STEPS = ((1.0, 30.0), (10.0, 30.0), (50.0, 30.0))
#: The 10% step is held long enough for its slice to reject a regression of about 2x: held 10 s, a --quick run's bad
#: candidate passed it (p 7e-5 against 5e-5 per test) and was rolled back at 50%, having decided 4.6% of the traffic.
QUICK_BAD_STEPS = ((1.0, 10.0), (10.0, 30.0), (50.0, 10.0))
#: The request mix of every tenant: (name, weight, prompt tokens, output tokens, streamed). Long prompts go to the
#: large model under the route's rule.
MIX = (("short", 0.425, (40, 400), (8, 64), False), ("short stream", 0.425, (40, 400), (8, 64), True),
       ("long stream", 0.15, (1100, 1800), (16, 64), True))


@dataclass(frozen=True, slots=True)
class Plan:
    """One canary the run starts: its candidate and its rollout."""

    label: str  # good | bad
    change: str
    text: str
    rollout: dict[str, Any]
    timeout_s: float


@dataclass
class Watched:
    """One canary as the bench saw it: what the admin API answered, polled every :data:`POLL_S`."""

    plan: Plan
    started: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    #: ``(time.time(), status, step, percent)`` whenever one of them changed.
    timeline: list[tuple[float, str, int, float]] = field(default_factory=list)
    #: Step number -> its start, from the status' ``step_started_at`` (the database's clock).
    step_starts: dict[int, float] = field(default_factory=dict)
    #: Step number -> the guards it passed on (the status' ``passed_steps``: the next step's window starts
    #: afresh) or, for the step it ended in, those tested at its end.
    evidence: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    sent_at: float = 0.0
    answered_at: float = 0.0
    aborted: bool = False

    @property
    def version(self) -> int:
        return int(self.started["version"])

    @property
    def started_at(self) -> float:
        return wall(self.started["started_at"])

    @property
    def ended_at(self) -> float | None:
        end = self.final.get("ended_at")
        return wall(end) if end else None


def wall(iso: str) -> float:
    """A timestamp of the status (UTC, with or without its offset) as ``time.time()``."""
    at = datetime.fromisoformat(iso)
    return (at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp()


def rollout(steps: tuple[tuple[float, float], ...], min_requests: int) -> dict[str, Any]:
    """The admin API's ``rollout`` for ``steps`` ``(percent, hold seconds)``, by tenant, default guards and alpha."""
    return {"by": "tenant", "steps": [{"percent": p, "hold": h} for p, h in steps], "window": WINDOW_S,
            "min_requests": min_requests}


class CanaryRun:
    """The canary scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        quick = ctx.options.quick
        self.quick = quick
        self.rate = QUICK_RATE if quick else RATE
        self.min_requests = QUICK_MIN_REQUESTS if quick else MIN_REQUESTS
        self.tenants = tenants(QUICK_TENANTS if quick else TENANTS)
        self.time_scale = ctx.options.time_scale or TIME_SCALE
        self.warmup_s = QUICK_WARMUP_S if quick else WARMUP_S
        self.settle_s = QUICK_SETTLE_S if quick else SETTLE_S
        self.tail_s = QUICK_TAIL_S if quick else TAIL_S
        self.good_steps = QUICK_GOOD_STEPS if quick else GOOD_STEPS
        self.bad_steps = QUICK_BAD_STEPS if quick else BAD_STEPS
        self.good_timeout_s = QUICK_GOOD_TIMEOUT_S if quick else GOOD_TIMEOUT_S
        self.bad_timeout_s = QUICK_BAD_TIMEOUT_S if quick else BAD_TIMEOUT_S
        self.token = secrets.token_urlsafe(24)
        self.results: list[Result] = []
        self.starts: dict[str, float] = {}  # replica name -> its load's start, as time.time()
        self.watched: list[Watched] = []
        self.gateways: list[GatewayHandle] = []
        self.load_began = 0.0
        self.load_ended = 0.0

    def run(self) -> None:
        ctx = self.ctx
        ports = free_ports(SMALL_ENGINES + LARGE_ENGINES)
        policy = ctx.state_dir / "policies.yaml"
        self.base = base_policy(ports[:SMALL_ENGINES], ports[SMALL_ENGINES:])
        policy.write_text(self.base)
        env = state_env(ctx.state_dir / "switchyard", policy)
        env |= {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_ADMIN_TOKEN": self.token}
        ctx.say(f"{NAME}: {len(ports)} simulated engines, {REPLICAS} gateway replicas on SQLite, "
                f"{len(self.tenants)} tenants")
        start_sims(ctx.procs, f"{NAME}-sims", policy, ports, time_scale=self.time_scale, seed=ctx.options.seed)
        run_cli(["db", "upgrade"], env)
        with ThreadPoolExecutor(1) as pool:  # the keys are made while the gateways start
            keys = pool.submit(create_keys, env, self.tenants)
            self.gateways = [start_gateway(ctx.procs, f"{NAME}-gateway-{name}", env) for name in "AB"[:REPLICAS]]
            self.keys = keys.result()
        self.plans = [Plan("good", GOOD_CHANGE, good_candidate(self.base), rollout(self.good_steps, self.min_requests),
                           self.good_timeout_s),
                      Plan("bad", BAD_CHANGE, bad_candidate(self.base), rollout(self.bad_steps, self.min_requests),
                           self.bad_timeout_s)]
        longest = (self.warmup_s + self.good_timeout_s + self.settle_s + self.bad_timeout_s + self.tail_s + 30.0)
        mix = [RequestTemplate(tenant=tenant, request_class=tier, model=ROUTE, weight=weight / len(self.tenants),
                               prompt_tokens=prompt, output_tokens=output, stream=stream, name=f"{tenant}:{kind}")
               for tenant, tier in self.tenants for kind, weight, prompt, output, stream in MIX]
        self.workloads = {f"replica {name}": poisson(self.rate / REPLICAS, longest, mix, ctx.options.seed + i)
                          for i, name in enumerate("AB"[:REPLICAS])}
        ctx.say(f"{NAME}: {self.rate:g} requests/s until both canaries end: a good candidate ({GOOD_CHANGE}), "
                f"then a bad one ({BAD_CHANGE})")
        asyncio.run(self._drive())

    async def _drive(self) -> None:
        starts = LoadStarts(self.starts)
        loads = [asyncio.create_task(run_open_loop(
            self.workloads[f"replica {name}"],
            Target(gw.base_url, f"replica {name}", api_keys=self.keys), progress=False,
            timeout_s=REQUEST_TIMEOUT_S, on_result=self.results.append, on_start=starts.recorder(name)))
            for name, gw in zip("AB", self.gateways, strict=False)]
        try:
            await starts.began.wait()
            self.load_began = time.time()
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"}) as session:
                await asyncio.sleep(self.warmup_s)
                for i, plan in enumerate(self.plans):
                    if i:
                        await asyncio.sleep(self.settle_s)
                    self.watched.append(await self._canary(session, plan))
                await asyncio.sleep(self.tail_s)
            self.load_ended = time.time()
        finally:
            for task in loads:
                task.cancel()
            done = await asyncio.gather(*loads, return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome

    async def _canary(self, session: aiohttp.ClientSession, plan: Plan) -> Watched:
        """Start ``plan``'s canary through replica A, follow it until it ends (or abort it at its timeout)."""
        base = self.gateways[0].base_url
        url = f"{base}/admin/api/policy/canary"
        seen = Watched(plan)
        seen.sent_at = time.time()
        body = {"yaml": plan.text, "rollout": plan.rollout, "message": f"bench canary: {plan.change}",
                "author": "bench"}
        async with session.post(url, json=body) as response:
            data = await response.json()
            if response.status != 201:
                raise RuntimeError(f"starting the {plan.label} canary answered {response.status}: {data}")
        seen.answered_at = time.time()
        seen.started = data
        self.ctx.say(f"{NAME}: canary {data['id']} of v{data['version']} ({plan.label} candidate) started at "
                     f"{data['percent']:g}%")
        deadline = time.monotonic() + plan.timeout_s
        status = data
        while True:
            self._note(seen, status)
            if status["status"] != "running" or status["id"] != data["id"]:
                break
            if time.monotonic() > deadline:
                async with session.post(f"{url}/abort", json={"reason": "the bench's time for it ran out",
                                                              "author": "bench"}) as response:
                    if response.status == 200:
                        seen.aborted = True
                        status = await response.json()
                        continue
            await asyncio.sleep(POLL_S)
            async with session.get(url) as response:
                if response.status != 200:
                    raise RuntimeError(f"the canary's status answered {response.status}: {await response.text()}")
                status = await response.json()
        seen.final = status
        took = (seen.ended_at or time.time()) - seen.started_at
        self.ctx.say(f"{NAME}: canary {status['id']} {status['status']} after {took:.1f} s: {status.get('reason')}")
        return seen

    @staticmethod
    def _note(seen: Watched, status: dict[str, Any]) -> None:
        step = int(status["step"])
        seen.step_starts.setdefault(step, wall(status["step_started_at"]))
        seen.evidence[step] = list(status.get("guards_tested") or [])  # its window so far (or up to the end)
        for passed in status.get("passed_steps") or ():
            seen.evidence[int(passed["step"])] = list(passed["guards_tested"])
        entry = (time.time(), str(status["status"]), step, float(status["percent"]))
        if not seen.timeline or seen.timeline[-1][1:] != entry[1:]:
            seen.timeline.append(entry)

    def wall_of(self, result: Result) -> float:
        """When ``result`` was sent, as time.time()."""
        return self.starts[result.arm.removeprefix("replica ")] + result.sent_s


def run(ctx: ScenarioContext) -> Outcome:
    """Run the canary scenario and write its report into ``ctx.out_dir``."""
    r = CanaryRun(ctx)
    started = time.monotonic()
    r.run()
    if not r.results:
        raise RuntimeError("no request was answered")
    f = analyse(r)
    tables, goals, notes = tables_of(f), goals_of(f), notes_of(f, r)
    phases: dict[str, list[Result]] = {"before the bad candidate": [], "from the bad candidate on": []}
    split = r.watched[1].started_at if len(r.watched) > 1 else float("inf")
    for result in r.results:
        phases["before the bad candidate" if r.wall_of(result) < split else "from the bad candidate on"].append(result)
    arms = {name: rs for name, rs in phases.items() if rs}
    parameters = {"scenario": NAME, "rate": r.rate, "tenants": len(r.tenants), "replicas": REPLICAS,
                  "time_scale": r.time_scale, "min_requests": r.min_requests, "window_s": WINDOW_S,
                  "good_steps": [list(s) for s in r.good_steps], "bad_steps": [list(s) for s in r.bad_steps],
                  "quick": r.quick, "wall_s": time.monotonic() - started}
    report = build_report(arms, title="switchyard bench: canary (policy rollouts under load)",
                          parameters=parameters, seeds={"workload": ctx.options.seed}, tables=tables, goals=goals,
                          notes=notes)
    report["figures"] = f
    write_report(report, ctx.out_dir)
    return Outcome(NAME, "ok", summary_of(f), goals, tables[:1], f"{NAME}/report.md", notes=notes[:1])
