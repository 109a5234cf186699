"""The ``failover`` scenario's run: two regions of simulated engines with fault control, the gateway, a steady
load with the outages staged under it, then the goals and the report (what the scenario registry calls is
:func:`run`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import TENANT, TIER, two_region_policy
from switchyard.bench.procs import Proc, free_ports, wait_http
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, scrape_text
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.failover.analysis import FAILURES_LISTED, analyse, describe_kinds
from switchyard.bench.scenarios.failover.timeline import (
    ATTEMPTS,
    BUDGET,
    FALLBACKS,
    FINISHED,
    HELD,
    Counters,
    Outage,
    Timeline,
    read_counters,
)
from switchyard.bench.scenarios.failover.workload import (
    CONTEXT,
    FIRST_TOKEN_TIMEOUT_S,
    HEALTHY,
    HOME,
    KIND_WORDS,
    KINDS,
    KV_TOKENS,
    PHASE_S,
    PHASES,
    PROFILE,
    QUICK_PHASE_S,
    RATE,
    REGIONS,
    REPLICAS,
    SERVED,
    TIME_SCALE,
    mix,
)
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stack import create_key, post_faults, start_gateway, start_sims, state_env
from switchyard.bench.synthetic import poisson
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

CLIENT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 10.0
SCRAPE_TIMEOUT_S = 2.0
GOAL_SUCCESS = 0.999
#: The healthy region may receive at most this many requests per client request sent during an outage.
GOAL_HEALTHY_LOAD = 1.2


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
        workload = poisson(RATE, self.duration_s, mix(), seed)
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
