"""``failover`` (chaos): a region fails under steady interactive load, then comes back; twice, two ways.

Two regions of two simulated replicas each, one ``switchyard sim`` process per region, each with
its fault-injection control server (``--control-port``). Clients call ``chat-us`` or ``chat-eu``
(their home region, half each); each model falls back to the other region
(``bench.policies.two_region_policy``). A steady open-loop Poisson load of streaming interactive
requests runs throughout, in five phases (30 s each in a full run, a few seconds each with
``--quick``, ``--duration-s`` split evenly):

1. ``before``: both regions healthy;
2. ``down``: every us-east engine refuses connections (the control server's ``mode: down``: listening
   sockets closed, open keep-alive connections dropped), then is brought back (``mode: none``);
3. ``between``: both healthy again;
4. ``hang``: every us-east engine accepts inference requests and never answers a byte (``mode: hang``;
   ``/health`` still answers): only the gateway's first-token timeout (``resilience.first_token_timeout``,
   2 s here: these prompts' TTFT is tens of ms) and its breakers can tell;
5. ``after``: both healthy again.

The gateway runs with the policy's ``resilience`` defaults but for the first-token timeout.

Figures per outage: success rate of the requests sent during it (goal ≥ 99.9%, like the run's overall
success); *time to detect*: from the fault to the first token of the first us-east request served in
eu-west (a request that waited out the first-token timeout counts with its wait); *time to recover*:
from ``mode: none`` to the first token of the first us-east request served in us-east again; requests
that tried us-east first (``attempt=`` in the route header) or waited out the first-token timeout; and
*no retry storm*: endpoints tried per client request (route headers), the gateway's own counters
(``switchyard_upstream_attempts``, ``switchyard_fallbacks``, ``switchyard_retry_budget_exhausted``
deltas on its ``/metrics``), and how many requests the healthy region's engines received (finished,
running and waiting, from their ``/metrics``) against the client requests sent in the same window
(goal ≤ 1.2x). Per phase and home region: success, fallbacks, where requests were served, TTFT
p50/p90/p99/max. Every failed request is listed with how it failed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from switchyard.bench.loadgen import Target, run_open_loop
from switchyard.bench.policies import TENANT, TIER, two_region_policy
from switchyard.bench.procs import (
    Proc,
    create_key,
    free_ports,
    post_faults,
    start_gateway,
    start_sims,
    state_env,
    wait_http,
)
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, samples, scrape_text, sum_series
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.spec import Workload
from switchyard.bench.stats import percentiles
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

REGIONS = ("us-east", "eu-west")
#: The region that fails, and the one that must carry its load.
HOME, HEALTHY = REGIONS
POOLS = {"us-east": "chat-us", "eu-west": "chat-eu"}
REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
RATE = 20.0
#: The phases in order (``before``, then each outage followed by a healthy phase) and their seconds.
PHASES = ("before", "down", "between", "hang", "after")
PHASE_S = dict.fromkeys(PHASES, 30.0)
#: --quick: a few seconds each; the hang gets more, as it is found only after first-token timeouts.
QUICK_PHASE_S = {"before": 1.5, "down": 2.5, "between": 2.5, "hang": 4.5, "after": 4.0}
#: The outages staged, in order.
KINDS = PHASES[1:-1:2]
#: The gateway's first-token timeout for this workload (prompts of 200-800 tokens: TTFT of tens of ms).
FIRST_TOKEN_TIMEOUT_S = 2.0
TIME_SCALE = 1.0
CLIENT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 10.0
SCRAPE_TIMEOUT_S = 2.0
GOAL_SUCCESS = 0.999
#: The healthy region may receive at most this many requests per client request sent during an outage.
GOAL_HEALTHY_LOAD = 1.2
KV_TOKENS = 100_000
CONTEXT = 8192
KIND_WORDS = {"down": "connection refused", "hang": "accepts, never answers"}

ATTEMPTS = "switchyard_upstream_attempts_total"
FALLBACKS = "switchyard_fallbacks_total"
BUDGET = "switchyard_retry_budget_exhausted_total"
FINISHED = "vllm:request_success_total"
#: Requests an engine holds (a request it received is finished, running or waiting).
HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: An attempt outcome the gateway counts on top of the attempt's own ``ok`` (a stream cut after its first byte).
#: Failed requests listed one by one in the report, at most.
FAILURES_LISTED = 30


@dataclass
class Counters:
    """Counters read at one instant: the gateway's and the healthy region's engines'.

    Attributes:
        at_s: When they were read (the load's clock).
        attempts: Gateway upstream attempts by pool and outcome (None: the gateway was not read).
        fallbacks: Gateway fallbacks by reason (None: not read, or not exported).
        budget_exhausted: Retries refused for an empty retry budget (None: not read, or not exported).
        healthy_received: Requests the healthy region's engines received so far: finished (any reason),
            running or waiting (None: one was not read).
    """

    at_s: float
    attempts: dict[str, dict[str, float]] | None = None
    fallbacks: dict[str, float] | None = None
    budget_exhausted: float | None = None
    healthy_received: float | None = None


def exported(text_: str, name: str) -> bool:
    """Whether a Prometheus text exposition declares counter ``name`` (``…_total``), with or without samples."""
    return any(f"# TYPE {family} " in text_ for family in (name, name.removesuffix("_total")))


def read_counters(at_s: float, gateway: str | None, healthy: Sequence[str | None]) -> Counters:
    """:class:`Counters` from the gateway's ``/metrics`` text and the healthy engines' (None: unread)."""
    attempts: dict[str, dict[str, float]] | None = None
    fallbacks: dict[str, float] | None = None
    budget: float | None = None
    if gateway is not None:
        attempts = {}
        for labels, value in samples(gateway, ATTEMPTS):
            by_outcome = attempts.setdefault(labels.get("pool", "-"), {})
            outcome = labels.get("outcome", "-")
            by_outcome[outcome] = by_outcome.get(outcome, 0.0) + value
        if exported(gateway, FALLBACKS):
            fallbacks = {}
            for labels, value in samples(gateway, FALLBACKS):
                reason = labels.get("reason", "-")
                fallbacks[reason] = fallbacks.get(reason, 0.0) + value
        if exported(gateway, BUDGET):
            budget = sum(v for _, v in samples(gateway, BUDGET))
    received = None if not healthy or any(t is None for t in healthy) else \
        sum(sum_series(t, name) for t in healthy if t is not None for name in (FINISHED, *HELD))
    return Counters(at_s, attempts, fallbacks, budget, received)


def counter_deltas(lo: Counters | None, hi: Counters | None) -> dict[str, Any]:
    """What the counters grew by from ``lo`` to ``hi`` (None where either side is unknown)."""

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    out: dict[str, Any] = {"attempts": None, "attempts_by_pool": None, "fallbacks": None, "fallbacks_by_reason": None,
                           "budget_exhausted": None, "healthy_received": None}
    if lo is None or hi is None:
        return out
    if lo.attempts is not None and hi.attempts is not None:
        pools: dict[str, dict[str, float]] = {}
        for pool, outcomes in hi.attempts.items():
            for outcome, value in outcomes.items():
                grown = value - lo.attempts.get(pool, {}).get(outcome, 0.0)
                if grown:
                    pools.setdefault(pool, {})[outcome] = grown
        out["attempts_by_pool"] = pools
        out["attempts"] = sum(v for outcomes in pools.values() for v in outcomes.values())
    if lo.fallbacks is not None and hi.fallbacks is not None:
        reasons = {k: v - lo.fallbacks.get(k, 0.0) for k, v in hi.fallbacks.items() if v - lo.fallbacks.get(k, 0.0)}
        out["fallbacks_by_reason"] = reasons
        out["fallbacks"] = sum(reasons.values())
    out["budget_exhausted"] = minus(hi.budget_exhausted, lo.budget_exhausted)
    out["healthy_received"] = minus(hi.healthy_received, lo.healthy_received)
    return out


@dataclass
class Outage:
    """One staged outage of the us-east engines, in seconds on the load's clock (from its start).

    Attributes:
        kind: The fault mode (``down`` or ``hang``).
        start_s: The fault was sent to the control server.
        applied_s: The control server answered (every us-east engine is in the mode).
        end_s: ``mode: none`` was sent.
        restored_s: The control server answered it.
        ready_s: Every us-east engine answered ``/health`` again.
        before: Counters read just before the fault.
        after: Counters read just before the end.
    """

    kind: str
    start_s: float | None = None
    applied_s: float | None = None
    end_s: float | None = None
    restored_s: float | None = None
    ready_s: float | None = None
    before: Counters | None = None
    after: Counters | None = None


@dataclass
class Timeline:
    """The run's outages and the counters at its edges.

    Attributes:
        start: Loop time of the load's start.
        outages: The outages staged, in order.
        first: Counters read before the load began (at 0).
        last: Counters read after every request ended.
        errors: What went wrong while staging.
    """

    start: float | None = None
    outages: list[Outage] = field(default_factory=list)
    first: Counters | None = None
    last: Counters | None = None
    errors: list[str] = field(default_factory=list)


def _mix() -> list[RequestTemplate]:
    return [RequestTemplate(tenant=TENANT, request_class=region, model=f"chat-{region.split('-')[0]}",
                            prompt_tokens=(200, 800), output_tokens=(16, 48), stream=True, name=region)
            for region in REGIONS]


def served_region(result: Result) -> str | None:
    """The region that served ``result`` (from its route header)."""
    return result.route_fields.get("region")


def served_at(result: Result) -> float:
    """When ``result`` was served: its first token (its end when none came)."""
    return result.first_token_s if result.first_token_s is not None else result.done_s


def attempts_of(result: Result) -> int:
    """Endpoints the gateway tried for ``result``: ``attempt=`` of its route header (a success), else its
    ``x-switchyard-attempts`` header (a failure after several), else 1."""
    attempt = result.route_fields.get("attempt")
    if attempt is not None and attempt.isdigit():
        return int(attempt)
    return result.attempts or 1


def tried_first(result: Result) -> bool:
    """Whether the gateway tried another endpoint before the one that served ``result``."""
    return attempts_of(result) > 1


def sent_between(results: Sequence[Result], lo: float | None, hi: float | None) -> list[Result]:
    """The results sent in ``[lo, hi)`` (None: unbounded)."""
    return [r for r in results if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)]


def failure_kinds(results: Sequence[Result]) -> dict[str, int]:
    """Failed requests counted by status and error type (``502 upstream_error``)."""
    kinds = Counter(f"{r.status or '-'} {r.error_type or ''}".strip() for r in results if not r.ok)
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def describe_kinds(kinds: Mapping[str, int]) -> str:
    """``502 upstream_error (3), 0 timeout (1)`` ('' when none)."""
    return ", ".join(f"{kind} ({count})" for kind, count in kinds.items())


def phase_windows(line: Timeline) -> list[tuple[str, float | None, float | None, Counters | None, Counters | None]]:
    """The run's phases by send time: name, start, end and the counters read at both edges.

    ``before`` runs up to the first outage, each outage from its fault to its end, ``between``
    from one outage's end to the next one's fault, ``after`` from the last end; an outage that
    was never staged ends the list there (its time belongs to the phase before it).
    """
    out: list[tuple[str, float | None, float | None, Counters | None, Counters | None]] = []
    name, lo, counters_lo = "before", None, line.first
    staged = [o for o in line.outages if o.start_s is not None]
    for index, outage in enumerate(staged):
        out.append((name, lo, outage.start_s, counters_lo, outage.before))
        if outage.end_s is None:
            name, lo, counters_lo = outage.kind, outage.start_s, outage.before
            break
        out.append((outage.kind, outage.start_s, outage.end_s, outage.before, outage.after))
        name = "between" if index < len(staged) - 1 else "after"
        lo, counters_lo = outage.end_s, outage.after
    out.append((name, lo, None, counters_lo, line.last))
    return out


def phase_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase and home region: requests, success, fallbacks, where they were served, TTFT."""
    rows = []
    for phase, lo, hi, _, _ in phase_windows(line):
        window = sent_between(results, lo, hi)
        for home in REGIONS:
            rs = [r for r in window if r.request_class == home]
            ok = [r for r in rs if r.ok]
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            ttft = percentiles(ttfts, (50, 90, 99))
            rows.append({"phase": phase, "home": home, "from_s": lo, "to_s": hi, "requests": len(rs),
                         "ok_rate": len(ok) / len(rs) if rs else None,
                         "fallback_rate": sum(r.fell_back for r in rs) / len(rs) if rs else None,
                         "in_home": sum(served_region(r) == home for r in ok) / len(ok) if ok else None,
                         "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"], "ttft_p99_s": ttft["p99"],
                         "ttft_max_s": max(ttfts) if ttfts else None})
    return rows


def _pool_attempts(pools: Mapping[str, Mapping[str, float]] | None, pool: str, *,
                   failed: bool = False) -> float | None:
    if pools is None:
        return None
    return sum(v for k, v in pools.get(pool, {}).items() if not (failed and k == "ok"))


def analyse_outage(results: Sequence[Result], outage: Outage, *, home: str = HOME,
                   first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S) -> dict[str, Any]:
    """One outage's figures: success, detection, recovery, and the load the gateway put on each region."""
    start, end = outage.start_s, outage.end_s
    row: dict[str, Any] = {"outage": outage.kind, "start_s": start, "end_s": end,
                           "duration_s": end - start if start is not None and end is not None else None}
    window = sent_between(results, start, end) if start is not None else []
    ours = [r for r in window if r.request_class == home]
    ok = [r for r in window if r.ok]
    ours_ok = [r for r in ours if r.ok]
    row.update(requests=len(window), ok=len(ok), ok_rate=len(ok) / len(window) if window else None,
               home_requests=len(ours), home_ok_rate=len(ours_ok) / len(ours) if ours else None,
               failures=describe_kinds(failure_kinds(window)))
    away = [served_at(r) for r in ours_ok if served_region(r) != home]
    row["detect_s"] = min(away) - start if away and start is not None else None
    back = [served_at(r) for r in results if r.request_class == home and r.ok and end is not None
            and r.sent_s >= end and served_region(r) == home]
    row["recover_s"] = min(back) - end if back and end is not None else None
    retried = [r for r in ours_ok if tried_first(r)]
    row["tried_home_first"] = len(retried)
    row["last_tried_home_s"] = max(r.sent_s for r in retried) - start if retried and start is not None else None
    row["waited_timeout"] = sum(1 for r in ours_ok if (r.service_ttft_s or 0.0) >= first_token_timeout_s)
    cut = [r for r in results if start is not None and r.sent_s < start < r.done_s and not r.ok]
    row["cut_in_flight"] = len(cut)
    row["cut_kinds"] = describe_kinds(failure_kinds(cut))
    row.update(load_figures(window, outage.before, outage.after, home=home))
    return row


def load_figures(window: Sequence[Result], lo: Counters | None, hi: Counters | None, *,
                 home: str = HOME) -> dict[str, Any]:
    """The load the requests sent in a window put on each region: endpoints tried per request (route
    headers), the gateway's counters and what the healthy region's engines received, from ``lo`` to ``hi``."""
    deltas = counter_deltas(lo, hi)
    pools = deltas["attempts_by_pool"]
    home_pool = POOLS[home]
    healthy_pool = next(pool for region, pool in POOLS.items() if region != home)
    tried = sum(attempts_of(r) for r in window)
    received = deltas["healthy_received"]
    return {**deltas, "client_attempts": tried, "attempts_per_request": tried / len(window) if window else None,
            "home_attempts": _pool_attempts(pools, home_pool),
            "home_failed_attempts": _pool_attempts(pools, home_pool, failed=True),
            "healthy_attempts": _pool_attempts(pools, healthy_pool),
            "healthy_ratio": received / len(window) if received is not None and window else None}


def load_rows(results: Sequence[Result], line: Timeline) -> list[dict[str, Any]]:
    """Per phase: client requests sent, gateway attempts, and what the healthy region's engines received."""
    rows = []
    for phase, lo, hi, counters_lo, counters_hi in phase_windows(line):
        window = sent_between(results, lo, hi)
        rows.append({"phase": phase, "requests": len(window), **load_figures(window, counters_lo, counters_hi)})
    return rows


def failure_rows(results: Sequence[Result], line: Timeline, limit: int = FAILURES_LISTED) -> list[dict[str, Any]]:
    """The failed requests one by one (the first ``limit`` by send time): when, which phase, how they failed."""
    windows = phase_windows(line)
    rows = []
    for r in sorted((r for r in results if not r.ok), key=lambda r: r.sent_s)[:limit]:
        phase = next((name for name, lo, hi, _, _ in windows
                      if (lo is None or r.sent_s >= lo) and (hi is None or r.sent_s < hi)), "-")
        fields = r.route_fields
        rows.append({"sent_s": r.sent_s, "done_s": r.done_s, "phase": phase, "home": r.request_class,
                     "status": r.status, "error": r.error_type, "code": r.error_code, "chunks": r.chunks,
                     "attempts": attempts_of(r), "endpoint": fields.get("endpoint"),
                     "moved_on": fields.get("moved_on"), "message": (r.error_message or "")[:160]})
    return rows


def analyse(results: Sequence[Result], line: Timeline, *,
            first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S) -> dict[str, Any]:
    """Every figure of the run: per outage, per phase, the load per phase, and overall success."""
    return {"outages": [analyse_outage(results, o, first_token_timeout_s=first_token_timeout_s)
                        for o in line.outages if o.start_s is not None],
            "phases": phase_rows(results, line), "load": load_rows(results, line),
            "success": sum(r.ok for r in results) / len(results) if results else None,
            "failures": sum(not r.ok for r in results), "requests": len(results),
            "failure_kinds": failure_kinds(results), "failed": failure_rows(results, line)}


class Failover:
    """The failover scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.phase_s = dict.fromkeys(PHASES, opts.duration_s / len(PHASES)) if opts.duration_s else \
            dict(QUICK_PHASE_S if opts.quick else PHASE_S)
        self.duration_s = sum(self.phase_s.values())
        self.time_scale = opts.time_scale or TIME_SCALE
        self.first_token_timeout_s = FIRST_TOKEN_TIMEOUT_S
        self.line = Timeline(outages=[Outage(kind) for kind in KINDS])
        self.results: list[Result] = []
        self.series: dict[str, list[float]] = {}
        self.workload: Workload | None = None

    def run(self) -> None:
        ctx = self.ctx
        procs = ctx.procs
        ports = free_ports(2 * REPLICAS + 2)
        us, eu = ports[:REPLICAS], ports[REPLICAS:2 * REPLICAS]
        control = {"us-east": ports[-2], "eu-west": ports[-1]}
        policy = ctx.state_dir / "policies.yaml"
        policy.write_text(two_region_policy(us, eu, served_model=SERVED, profile=PROFILE, kv_cache_tokens=KV_TOKENS,
                                            context_window=CONTEXT, first_token_timeout=self.first_token_timeout_s))
        ctx.say("failover: starting two regions of simulated engines (with fault control) and the gateway")
        seed = ctx.options.seed
        region_ports = {"us-east": us, "eu-west": eu}
        env = state_env(ctx.state_dir / "switchyard", policy)
        with ThreadPoolExecutor(len(REGIONS) + 1) as pool:  # the regions' engines and the key, side by side
            starting = {region: pool.submit(start_sims, procs, f"failover-sims-{region}", policy, region_ports[region],
                                            time_scale=self.time_scale, seed=seed, regions=[region],
                                            control_port=control[region]) for region in REGIONS}
            made = pool.submit(create_key, env, TENANT, TIER)
            sims: dict[str, Proc] = {region: future.result() for region, future in starting.items()}
            key = made.result()
        gateway = start_gateway(procs, "failover-gateway", env)
        workload = poisson(RATE, self.duration_s, _mix(), seed)
        samplers = {region: MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in region_ports[region]],
                                           ["vllm:num_requests_running"]) for region in REGIONS}
        line = self.line
        began = asyncio.Event()
        gateway_metrics = f"{gateway.base_url}/metrics"
        healthy_metrics = [f"http://127.0.0.1:{p}/metrics" for p in region_ports[HEALTHY]]

        def started(at: float) -> None:
            line.start = at
            began.set()
            for sampler in samplers.values():
                sampler.start(at)

        async def counters(session: aiohttp.ClientSession, at_s: float) -> Counters:
            texts = await asyncio.gather(scrape_text(session, gateway_metrics, SCRAPE_TIMEOUT_S),
                                         *(scrape_text(session, u, SCRAPE_TIMEOUT_S) for u in healthy_metrics))
            return read_counters(at_s, texts[0], texts[1:])

        async def set_mode(mode: str) -> None:
            answer = await asyncio.to_thread(post_faults, control[HOME], {"region": HOME, "mode": mode})
            engines = [e for e in answer.get("engines", []) if e.get("region") == HOME]
            wrong = [e.get("url") for e in engines if (e.get("faults") or {}).get("mode") != mode]
            if not engines or wrong:
                raise RuntimeError(f"the control server did not put every {HOME} engine in mode {mode}: {answer}")

        async def stage(session: aiohttp.ClientSession) -> None:
            loop = asyncio.get_running_loop()
            await began.wait()
            assert line.start is not None
            start = line.start

            def now() -> float:
                return loop.time() - start

            for outage in line.outages:
                at = sum(self.phase_s[p] for p in PHASES[:PHASES.index(outage.kind)])
                lasts = self.phase_s[outage.kind]
                await asyncio.sleep(max(0.0, at - now()))
                ctx.say(f"failover: {HOME} engines {outage.kind} ({KIND_WORDS[outage.kind]}) for {lasts:g} s")
                outage.before = await counters(session, now())
                outage.start_s = now()
                await set_mode(outage.kind)
                outage.applied_s = now()
                await asyncio.sleep(max(0.0, at + lasts - now()))
                ctx.say(f"failover: {HOME} engines back")
                outage.after = await counters(session, now())
                outage.end_s = now()
                await set_mode("none")
                outage.restored_s = now()
                for port in region_ports[HOME]:
                    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", sims[HOME],
                                            READY_TIMEOUT_S)
                outage.ready_s = now()

        async def drive() -> list[Result]:
            async with aiohttp.ClientSession() as session:
                line.first = await counters(session, 0.0)
                faults = asyncio.create_task(stage(session))
                try:
                    results = await run_open_loop(
                        workload, Target(gateway.base_url, "switchyard", default_api_key=key),
                        progress=ctx.options.progress, timeout_s=CLIENT_TIMEOUT_S, on_start=started)
                except BaseException:
                    faults.cancel()  # interrupted: do not stage the rest
                    raise
                finally:
                    try:
                        await faults
                    except asyncio.CancelledError:
                        pass
                    except Exception as exc:  # reported, and the run's figures say what they can
                        line.errors.append(f"{type(exc).__name__}: {exc}")
                        if any(o.start_s is not None for o in line.outages):  # never leave the region failed
                            try:
                                await asyncio.to_thread(post_faults, control[HOME], {"mode": "none"})
                            except OSError as again:
                                line.errors.append(f"{type(again).__name__}: {again}")
                    for sampler in samplers.values():
                        await sampler.stop()
                end = max((r.done_s for r in results), default=0.0)
                line.last = await counters(session, end)
                return results

        ctx.say(f"failover: {len(workload)} requests over {self.duration_s:g} s ("
                + ", ".join(f"{p} {self.phase_s[p]:g} s" for p in PHASES) + ")")
        self.results = asyncio.run(drive())
        self.workload = workload
        self.series = {f"{region} engines running": s.series["vllm:num_requests_running"]
                       for region, s in samplers.items()}
        procs.stop_all()  # the gateway and both regions' engines, side by side
        if line.errors:
            raise RuntimeError("the outages could not be staged: " + "; ".join(line.errors))


def _timeline_table(line: Timeline, outages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    figures = {o["outage"]: o for o in outages}
    for outage in line.outages:
        if outage.start_s is None:
            continue
        f = figures.get(outage.kind, {})
        rows += [
            {"what": f"{HOME} {outage.kind} ({KIND_WORDS[outage.kind]})", "at_s": outage.start_s,
             "note": "fault sent to the control server"},
            {"what": "  in effect", "at_s": outage.applied_s, "note": "the control server answered"},
            {"what": "  time to detect", "at_s": f.get("detect_s"),
             "note": f"fault → first token of the first {HOME} request served in {HEALTHY}"},
            {"what": f"{HOME} back (mode none)", "at_s": outage.end_s, "note": ""},
            {"what": "  answering /health", "at_s": outage.ready_s, "note": f"every {HOME} engine"},
            {"what": "  time to recover", "at_s": f.get("recover_s"),
             "note": f"back → first token of the first {HOME} request served in {HOME} again"}]
    return table("Outage timeline", [text("what", "what"), num("at_s", "s", 2), text("note", "note")], rows,
                 "Times in seconds from the start of the load; detection and recovery are durations.")


def _load_note(o: Mapping[str, Any]) -> str:
    if o["healthy_received"] is None:
        return f"the {HEALTHY} engines' counters could not be read"
    note = f"{HEALTHY} engines received {o['healthy_received']:.0f} for {o['requests']} client requests sent"
    if o["attempts"] is not None:
        note += f"; the gateway made {o['attempts']:.0f} attempts ({o['home_attempts']:.0f} to {HOME})"
    return note


def run(ctx: ScenarioContext) -> Outcome:
    """Run the failover (chaos) scenario and write its report into ``ctx.out_dir``."""
    f = Failover(ctx)
    started = time.monotonic()
    f.run()
    line = f.line
    ftt = f.first_token_timeout_s
    a = analyse(f.results, line, first_token_timeout_s=ftt)
    outages = table(
        "Outages: success, detection, recovery",
        [text("outage", "outage"), num("requests", "requests sent", 0), pct("ok_rate", "ok %", 2),
         pct("home_ok_rate", f"{HOME} ok %", 2), num("detect_s", "detect s", 2), num("recover_s", "recover s", 2),
         num("tried_home_first", f"tried {HOME} first", 0), num("last_tried_home_s", "last of them at +s", 1),
         num("waited_timeout", "waited out first-token timeout", 0),
         num("cut_in_flight", "in flight at the fault, failed", 0), text("failures", "failures sent during it")],
        a["outages"],
        f"Requests by send time within the outage (both home regions). *tried {HOME} first*: served after a failed "
        f"attempt (`attempt=` in the route header), the last one's send time from the fault; *waited out*: first "
        f"token ≥ the first-token timeout ({ftt:g} s) after sending; *in flight at the fault*: sent before it, "
        f"failed after it (streams the fault cut).")
    load = table(
        "No retry storm: gateway attempts and the healthy region's load, per phase",
        [text("phase", "phase"), num("requests", "client requests", 0),
         ratio("attempts_per_request", "attempts / request"), num("attempts", "gateway attempts", 0),
         num("home_attempts", f"to {HOME}", 0),
         num("home_failed_attempts", f"to {HOME} failed", 0), num("healthy_attempts", f"to {HEALTHY}", 0),
         num("fallbacks", "fallbacks", 0), num("budget_exhausted", "retry budget exhausted", 0),
         num("healthy_received", f"{HEALTHY} engines received", 0),
         ratio("healthy_ratio", f"{HEALTHY} received / client requests")],
        a["load"],
        "Client requests by send time in the phase. *attempts / request*: endpoints tried per client request, from "
        "each response's route header (`attempt=`) or `x-switchyard-attempts`. The gateway's counters "
        f"(`{ATTEMPTS}`, `{FALLBACKS}`, `{BUDGET}`) count an attempt when it "
        "ends and are read at the phase's edges: an attempt that ends after the edge (a hung one waits out the "
        f"first-token timeout) counts in the next phase. *{HEALTHY} engines received*: their finished (any reason), "
        f"running and waiting requests (`{FINISHED}`, `{HELD[0]}`, `{HELD[1]}`) at the edges: counted on arrival. "
        f"In an outage every request should land in {HEALTHY} once: 1.00x is ideal, more is retries.")
    phases = table(
        "Requests per phase and home region",
        [text("phase", "phase"), text("home", "home"), num("requests", "requests", 0), pct("ok_rate", "ok %", 2),
         pct("fallback_rate", "fallback %"), pct("in_home", "served at home %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p90_s", "TTFT p90 ms", 0), ms("ttft_p99_s", "TTFT p99 ms", 0), ms("ttft_max_s", "TTFT max ms", 0)],
        a["phases"], "Phases by send time; TTFT from the scheduled time, of the requests that succeeded.")
    timeline = _timeline_table(line, a["outages"])
    failed = table(
        "Failed requests",
        [num("sent_s", "sent s", 2), num("done_s", "ended s", 2), text("phase", "phase"), text("home", "home"),
         num("status", "status", 0), text("error", "error"), text("code", "code"), num("chunks", "chunks", 0),
         num("attempts", "attempts", 0), text("endpoint", "endpoint"), text("moved_on", "moved on from"),
         text("message", "message")],
        a["failed"], f"Every failed request (the first {FAILURES_LISTED}), by send time; *chunks*: content chunks "
        "received before it failed (a stream cut after its first byte cannot move to another endpoint).")
    success = a["success"]
    sent = sum(o["requests"] for o in a["outages"])
    served = sum(o["ok"] for o in a["outages"])
    through = served / sent if sent else None
    cut = sum(o["cut_in_flight"] for o in a["outages"])
    # The goal: interactive requests *through* the outage, i.e. sent while it lasted. Streams that were
    # already running on the engines when they were killed are cut after their first bytes, which no gateway can
    # save (it may not fall back once bytes went out): they are counted in the whole run's success, shown too.
    note = f"{sent - served} of {sent} failed"
    if success is not None:
        note += (f"; over the whole run {a['failures']} of {a['requests']} failed ({100 * success:.2f}% ok), "
                 f"{cut} of them streams in flight at a fault"
                 + (f": {describe_kinds(a['failure_kinds'])}" if a["failure_kinds"] else ""))
    goals = [goal("successful requests sent during the outages", f"≥ {GOAL_SUCCESS * 100:g}%", through,
                  None if through is None else through >= GOAL_SUCCESS, unit="%", multiplier=100, decimals=2,
                  note=note)]
    for o in a["outages"]:
        rate = o["ok_rate"]
        goals.append(goal(f"successful requests sent during the {o['outage']} outage", f"≥ {GOAL_SUCCESS * 100:g}%",
                          rate, None if rate is None else rate >= GOAL_SUCCESS, unit="%", multiplier=100, decimals=2,
                          note=f"{o['requests'] - o['ok']} of {o['requests']} failed"
                          + (f": {o['failures']}" if o["failures"] else "")
                          + (f"; besides, {o['cut_in_flight']} in flight at the fault failed ({o['cut_kinds']})"
                             if o["cut_in_flight"] else "")))
    for o in a["outages"]:
        load_ratio = o["healthy_ratio"]
        goals.append(goal(f"no retry storm: {HEALTHY} requests per client request during the {o['outage']} outage",
                          f"≤ {GOAL_HEALTHY_LOAD:g}x", load_ratio,
                          None if load_ratio is None else load_ratio <= GOAL_HEALTHY_LOAD, unit="x",
                          note=_load_note(o)))
    notes = [f"{RATE:g} requests/s (streamed, 200-800 prompt tokens, 16-48 output tokens), half with home {HOME} "
             f"(`chat-us`), half {HEALTHY} (`chat-eu`); {REPLICAS} replicas of `{PROFILE}` per region at time scale "
             f"{f.time_scale:g}, one simulator process per region; phases: "
             + ", ".join(f"{p} {f.phase_s[p]:g} s" for p in PHASES) + ".",
             f"Gateway: the policy's resilience defaults (health probes every second, endpoint and pool "
             f"breakers, retry budget; see the README) with first_token_timeout {ftt:g} s.",
             "Faults come from the simulator's control server (`switchyard sim --control-port`): `down` closes the "
             "engines' listening sockets and drops their open connections (streams in flight are cut: no gateway "
             "can save those), `hang` accepts and never answers."]
    parameters = {"scenario": "failover", "rate": RATE, "duration_s": f.duration_s, "phase_s": f.phase_s,
                  "outages": list(KINDS), "first_token_timeout_s": ftt,
                  "time_scale": f.time_scale, "replicas_per_region": REPLICAS, "profile": PROFILE,
                  "timeline": [{"kind": o.kind, "start_s": o.start_s, "applied_s": o.applied_s, "end_s": o.end_s,
                                "restored_s": o.restored_s, "ready_s": o.ready_s} for o in line.outages],
                  "wall_s": time.monotonic() - started}
    tables = [outages, load, phases, timeline, failed]
    report = build_report({"switchyard": f.results}, title="switchyard bench: failover (chaos: region outages)",
                          workload=f.workload, parameters=parameters, seeds={"workload": ctx.options.seed},
                          tables=tables, goals=goals, notes=notes, extra_series={"switchyard": f.series})
    write_report(report, ctx.out_dir)
    parts = [f"{100 * success:.2f}% ok" if success is not None else "no requests"]
    for o in a["outages"]:
        bits = [f"detect {o['detect_s']:.2f} s" if o["detect_s"] is not None else "not detected",
                f"recover {o['recover_s']:.2f} s" if o["recover_s"] is not None else "not recovered",
                f"{o['ok_rate'] * 100:.2f}% ok" if o["ok_rate"] is not None else "no requests"]
        if o["healthy_ratio"] is not None:
            bits.append(f"{HEALTHY} load {o['healthy_ratio']:.2f}x")
        parts.append(f"{o['outage']}: " + ", ".join(bits))
    return Outcome("failover", "ok", "; ".join(parts), goals, [outages, load], "failover/report.md", notes=notes)
