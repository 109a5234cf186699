"""The ``failover`` scenario's report: its tables, the issue's four goals, the notes, and the Outcome's summary
line."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.failover.analysis import FAILURES_LISTED, SLOWEST_LISTED, analyse
from switchyard.bench.scenarios.failover.phases import describe_kinds
from switchyard.bench.scenarios.failover.timeline import ATTEMPTS, FINISHED, HANGS, HEDGES, HELD, RESUMES, Timeline
from switchyard.bench.scenarios.failover.workload import (
    COMPLETE_OUTPUT,
    DEADLINE_S,
    HEALTHY,
    HEDGE_AFTER,
    HOME,
    KIND_WORDS,
    KINDS,
    PHASES,
    PROFILE,
    PROMPT_TOKENS,
    RATE,
    REPLICAS,
    STREAM_OUTPUT,
    TTFT_OBJECTIVE_S,
    WAIT_SLACK_S,
)
from switchyard.bench.spec import Workload
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text

#: Requests answered completely in each outage phase, at least.
GOAL_COMPLETE = 0.9999
#: The hang detected (every engine of the region out of service) and traffic moved off it within this.
GOAL_DETECT_S = 2.0
#: No client waits longer than its class's first-token deadline plus this.
GOAL_WAIT_S = DEADLINE_S + WAIT_SLACK_S
#: Engine requests per client request over the whole run, at most (retries, resumes and hedges included).
GOAL_ENGINE_LOAD = 1.2


def _tables(a: Mapping[str, Any], line: Timeline) -> list[dict[str, Any]]:
    outages = table(
        "Outages: answered completely, resumed, hedged",
        [text("outage", "outage"), num("requests", "requests", 0), num("in_flight", "in flight at the fault", 0),
         num("streams", "streams", 0), pct("complete_rate", "complete %", 2), text("failures", "not complete"),
         num("in_flight_failed", "of them in flight", 0), num("broken", "streams broken", 0),
         num("resumes", "resumes", 0), num("resumed_requests", "requests resumed (log)", 0),
         num("hedges", "hedges sent", 0), num("hedged_requests", "requests hedged (log)", 0),
         num("short", "complete but short", 0)],
        a["outages"],
        "An outage's requests: sent while it lasted, or sent before and still running when it began (both home "
        "regions). *Complete*: 2xx, a `finish_reason`, no error event, a stream ended with `[DONE]`. *streams "
        f"broken*, *resumes*, *hedges sent*: the gateway's counters (`switchyard_streams_broken`, `{RESUMES}` "
        f"outcome resumed, `{HEDGES}` won + lost + failed) from the fault to the end. *(log)*: requests in the "
        "gateway's request log (`GET /admin/api/requests`) with a resume or a hedge. *complete but short*: fewer "
        "`completion_tokens` than `max_tokens` (every request sends `ignore_eos`).")
    detect = table(
        f"Detection, traffic moved, recovery ({HOME})",
        [text("outage", "outage"), num("out_first_s", "first out s", 2), num("out_all_s", "all out s", 2),
         text("out_reasons", "why"), num("hangs", "hangs counted", 0),
         num("first_away_s", f"first served in {HEALTHY} s", 2), num("tried_home", f"tried {HOME} first", 0),
         num("moved_s", "traffic moved s", 2), num("back_s", "back in service s", 2),
         num("recover_s", f"first served in {HOME} again s", 2)],
        a["outages"],
        f"Seconds from the fault (*back*, *again*: from its end). *out*: the gateway took the {HOME} engines out of "
        "service (`GET /admin/api/endpoints` polled every 0.1 s: up to 0.1 s late), the first one and all. "
        f"*hangs counted*: `{HANGS}`. *first served in {HEALTHY}*: the first token of the first {HOME} request sent "
        f"during the outage that {HEALTHY} served. *tried {HOME} first*: requests sent during the outage whose route "
        f"header names a {HOME} endpoint in `moved_on`; *traffic moved*: the last of them was sent this long after "
        f"the fault (0: none was). *back in service*: the gateway had every {HOME} engine in service again.")
    rows = [{"scope": o["outage"], **{k: o[k] for k in ("requests", "wait_max_s", "stream_wait_max_s",
                                                         "complete_wait_max_s", "gap_max_s", "lateness_max_s")}}
            for o in a["outages"]]
    rows.append({"scope": "whole run", **{k: a["run"][k] for k in ("requests", "wait_max_s", "stream_wait_max_s",
                                                                    "complete_wait_max_s", "gap_max_s",
                                                                    "lateness_max_s")}})
    waits = table(
        "Longest client waits",
        [text("scope", "requests"), num("requests", "requests", 0), ms("wait_max_s", "longest wait ms", 0),
         ms("stream_wait_max_s", "streams: first token ms", 0),
         ms("complete_wait_max_s", "complete answers: whole ms", 0), ms("gap_max_s", "longest mid-stream gap ms", 0),
         ms("lateness_max_s", "generator lateness ms", 0)],
        rows,
        f"From the scheduled time (the load generator's own lateness included, shown apart). A stream waits for "
        f"its first token; a complete answer's whole time is an upper bound of its wait. Goal: ≤ the class's "
        f"first-token deadline ({DEADLINE_S:g} s: twice its ttft_objective) + {WAIT_SLACK_S:g} s. *mid-stream gap*: "
        "the longest silence between two chunks of a stream (where a broken stream waited for its resume).")
    slowest = table(
        "The longest waits",
        [num("sent_s", "sent s", 2), text("phase", "phase"), text("home", "home"), text("stream", "stream"),
         ms("wait_s", "wait ms", 0), ms("lateness_s", "generator lateness ms", 0), text("complete", "complete"),
         text("region", "served in"), text("attempt", "attempt"), text("moved_on", "moved on from"),
         text("hedged", "hedged")],
        a["slowest"], f"The {SLOWEST_LISTED} requests whose clients waited longest (as above), from their route "
        "header: the region that started the answer, the try that did, what the gateway moved on from and why "
        "(`hung`, `first_token_timeout`, `connect_error`, …), and the other endpoint of a hedge.")
    run = a["run"]
    load_rows = [*a["load"], {"phase": "whole run", "requests": run["requests"], "attempts": run["attempts"],
                              "hedges": run["hedges"], "resumes": run["resumes"], "fallbacks": run["fallbacks"],
                              "budget_exhausted": run["budget_exhausted"],
                              "home_received": run["received"].get(HOME),
                              "healthy_received": run["received"].get(HEALTHY),
                              "engine_requests": run["engine_requests"], "engine_ratio": run["engine_ratio"]}]
    load = table(
        "Engine requests per client request, per phase and over the run",
        [text("phase", "phase"), num("requests", "client requests", 0), num("attempts", "gateway attempts", 0),
         num("home_failed_attempts", f"to {HOME} failed", 0), num("fallbacks", "fallbacks", 0),
         num("hedges", "hedges", 0), num("resumes", "resumes", 0), num("budget_exhausted", "budget exhausted", 0),
         num("home_received", f"{HOME} engines received", 0), num("healthy_received", f"{HEALTHY} received", 0),
         ratio("engine_ratio", "engine requests / client request")],
        load_rows,
        "Client requests by send time in the phase; the counters are read at its edges. *engines received*: "
        f"finished (any reason), running and waiting (`{FINISHED}`, `{HELD[0]}`, `{HELD[1]}`), plus requests their "
        "client abandoned (the simulator's `/sim/state` `aborted`: vLLM counts none), summed over the region's "
        f"engines; unknown across an edge where they could not be read (down, killed). Over the run the killed "
        f"process's count at the kill is added to the new one's. `{ATTEMPTS}` counts a try when it ends (a hung "
        "try in the next phase). The gateway's breaker trials (one-token completions) reach engines too.")
    phases = table(
        "Requests per phase and home region",
        [text("phase", "phase"), text("home", "home"), num("requests", "requests", 0),
         pct("complete_rate", "complete %", 2), pct("fallback_rate", "fallback %"), pct("in_home", "served at home %"),
         ms("ttft_p50_s", "stream TTFT p50 ms", 0), ms("ttft_p99_s", "p99 ms", 0), ms("ttft_max_s", "max ms", 0),
         ms("wait_max_s", "longest wait ms", 0)],
        a["phases"], "Phases by send time; TTFT from the scheduled time, of the streams answered completely.")
    failed = table(
        "Requests not answered completely",
        [num("sent_s", "sent s", 2), num("done_s", "ended s", 2), text("phase", "phase"), text("home", "home"),
         text("stream", "stream"), num("status", "status", 0), text("error", "error"), text("code", "code"),
         num("chunks", "chunks", 0), num("max_tokens", "max_tokens", 0), text("endpoint", "endpoint"),
         text("moved_on", "moved on from"), text("message", "message")],
        a["failed"], f"As the client saw them (the first {FAILURES_LISTED}), by send time; *chunks*: content chunks "
        "received; *endpoint*, *moved on from*: the route header (where the answer started).")
    records = table(
        "The gateway's records of requests that did not end ok",
        [num("at_s", "arrived s", 2), text("phase", "phase"), text("stream", "stream"), num("status", "status", 0),
         text("outcome", "outcome"), text("code", "code"), text("endpoint", "endpoint"),
         num("attempts", "attempts", 0), num("resumes", "resumes", 0), num("hedges", "hedges", 0),
         text("moved_on", "moved on from"), text("trace", "last trace lines")],
        a["records"], f"From the request log (`GET /admin/api/requests`, read every 5 s; the first {FAILURES_LISTED}).")
    return [outages, detect, waits, load, phases, _timeline_table(line, a["outages"]), slowest, failed, records]


def _timeline_table(line: Timeline, outages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    figures = {o["outage"]: o for o in outages}
    for outage in line.outages:
        if outage.start_s is None:
            continue
        f = figures.get(outage.kind, {})
        end = "process started again" if outage.kind == "kill" else "mode none"
        rows += [
            {"what": f"{HOME} {outage.kind} ({KIND_WORDS[outage.kind]})", "at_s": outage.start_s,
             "note": "SIGKILL sent" if outage.kind == "kill" else "fault sent to the control server"},
            {"what": "  in effect", "at_s": outage.applied_s,
             "note": "the process was reaped" if outage.kind == "kill" else "the control server answered"},
            {"what": "  every engine out of service", "at_s": None if f.get("out_all_s") is None else
             outage.start_s + f["out_all_s"], "note": "the gateway's admin API"},
            {"what": f"{HOME} back ({end})", "at_s": outage.end_s, "note": ""},
            {"what": "  answering /health", "at_s": outage.ready_s, "note": f"every {HOME} engine"},
            {"what": "  back in service", "at_s": outage.back_s, "note": "the gateway's admin API"}]
    return table("Outage timeline", [text("what", "what"), num("at_s", "s", 2), text("note", "note")], rows,
                 "Times in seconds from the start of the load.")


def _goals(a: Mapping[str, Any]) -> list[dict[str, Any]]:
    goals = []
    for o in a["outages"]:
        rate = o["complete_rate"]
        note = f"{o['requests'] - o['complete']} of {o['requests']} not complete ({o['in_flight']} were in flight)"
        goals.append(goal(f"requests answered completely in the {o['outage']} phase", f"≥ {GOAL_COMPLETE * 100:g}%",
                          rate, None if rate is None else rate >= GOAL_COMPLETE, unit="%", multiplier=100,
                          decimals=2, note=note + (f": {o['failures']}" if o["failures"] else "")))
    hang = next((o for o in a["outages"] if o["outage"] == "hang"), None)
    if hang is not None:
        detected, moved = hang["out_all_s"], hang["moved_s"]
        worst = None if detected is None or moved is None else max(detected, moved)
        goals.append(goal(f"hang detected and traffic moved off {HOME}", f"≤ {GOAL_DETECT_S:g} s", worst,
                          None if worst is None else worst <= GOAL_DETECT_S, unit="s",
                          note=f"every {HOME} engine out of service after "
                          + (f"{detected:.2f} s" if detected is not None else "(never seen)")
                          + f"; the last request that tried {HOME} first was sent "
                          + (f"{moved:.2f} s" if moved is not None else "(none)") + " after the fault"))
    run = a["run"]
    wait = run["wait_max_s"]
    per = ", ".join(f"{o['outage']} {o['wait_max_s']:.2f} s" for o in a["outages"] if o["wait_max_s"] is not None)
    goals.append(goal("longest client wait (streams: first token; complete answers: whole time)",
                      f"≤ {GOAL_WAIT_S:g} s (deadline {DEADLINE_S:g} s + {WAIT_SLACK_S:g} s)", wait,
                      None if wait is None else wait <= GOAL_WAIT_S, unit="s",
                      note=f"whole run, in the {run['wait_max_phase']} phase; per outage: {per}"))
    load = run["engine_ratio"]
    goals.append(goal("engine requests per client request over the run", f"≤ {GOAL_ENGINE_LOAD:g}x", load,
                      None if load is None else load <= GOAL_ENGINE_LOAD, unit="x",
                      note=_load_note(run)))
    return goals


def _load_note(run: Mapping[str, Any]) -> str:
    if run["engine_requests"] is None:
        return "an engine's counters could not be read"
    return (f"the engines received {run['engine_requests']:.0f} for {run['requests']} client requests; the gateway: "
            + ", ".join(f"{k} {run[k]:.0f}" for k in ("attempts", "hedges", "resumes", "budget_exhausted")
                        if run[k] is not None))


def _summary(a: Mapping[str, Any]) -> str:
    run = a["run"]
    parts = [f"{100 * run['complete_rate']:.2f}% complete" if run["complete_rate"] is not None else "no requests"]
    for o in a["outages"]:
        bits = [f"{o['complete_rate'] * 100:.2f}% complete" if o["complete_rate"] is not None else "no requests",
                f"{o['resumes']:.0f} resumed" if o["resumes"] is not None else "resumes unknown"]
        if o["outage"] == "hang":
            bits.append(f"detected {o['out_all_s']:.2f} s" if o["out_all_s"] is not None else "not detected")
            bits.append(f"moved {o['moved_s']:.2f} s" if o["moved_s"] is not None else "not moved")
        parts.append(f"{o['outage']}: " + ", ".join(bits))
    if run["wait_max_s"] is not None:
        parts.append(f"longest wait {run['wait_max_s']:.2f} s")
    if run["engine_ratio"] is not None:
        parts.append(f"{run['engine_ratio']:.2f} engine requests per client request")
    return "; ".join(parts)


def write(ctx: ScenarioContext, results: Sequence[Result], line: Timeline, *, workload: Workload | None,
          series: Mapping[str, list[float]], phase_s: Mapping[str, float], time_scale: float,
          home_urls: Collection[str], wall_s: float) -> Outcome:
    """Analyse the run, write its report into ``ctx.out_dir``, and return its Outcome."""
    a = analyse(results, line, home_urls)
    goals = _goals(a)
    run = a["run"]
    notes = [
        f"{RATE:g} interactive requests/s (Poisson), half streamed ({STREAM_OUTPUT[0]}-{STREAM_OUTPUT[1]} output "
        f"tokens), half not ({COMPLETE_OUTPUT[0]}-{COMPLETE_OUTPUT[1]}), {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} prompt "
        f"tokens, `ignore_eos`; half with home {HOME} (`chat-us`), half {HEALTHY} (`chat-eu`), each falling back to "
        f"the other region. {REPLICAS} replicas of the simulator profile `{PROFILE}` per region at time scale "
        f"{time_scale:g} (about 6.5 ms a token), one simulator process per region; phases: "
        + ", ".join(f"{p} {phase_s[p]:g} s" for p in PHASES) + ".",
        f"Gateway: the policy's resilience defaults (health probes every second, breakers, retry budget 20% + 3/s, "
        f"hang_detection after 1 s, streams resumed; see the README); the class has ttft_objective "
        f"{TTFT_OBJECTIVE_S:g} s (first-token deadline {DEADLINE_S:g} s, also for complete answers) and hedges "
        f"streams at the pool's TTFT {HEDGE_AFTER}.",
        "Faults: `down` (the simulator's control server) closes the engines' listening sockets and drops their "
        "open connections, streams in flight included; `kill` SIGKILLs the region's simulator process (both "
        "engines and the control server) and starts it again on the same ports at the phase's end (empty caches, "
        "counters from zero); `hang` stalls the engines: running streams stop mid-answer, new requests are "
        "accepted and get nothing, the counters freeze, /health stays 200.",
        "Two cores run the load generator, the gateway and both simulator processes: timings are noisy "
        "(the generator's lateness is shown); a figure that looks off should be measured again.",
        "Not answered completely over the whole run: " + (describe_kinds(run["failure_kinds"]) or "none") + "."]
    parameters = {"scenario": "failover", "rate": RATE, "duration_s": sum(phase_s.values()), "phase_s": dict(phase_s),
                  "outages": list(KINDS), "ttft_objective_s": TTFT_OBJECTIVE_S, "first_token_deadline_s": DEADLINE_S,
                  "hedge_after": HEDGE_AFTER, "time_scale": time_scale, "replicas_per_region": REPLICAS,
                  "profile": PROFILE, "stream_output_tokens": list(STREAM_OUTPUT),
                  "complete_output_tokens": list(COMPLETE_OUTPUT),
                  "timeline": [{"kind": o.kind, "start_s": o.start_s, "applied_s": o.applied_s, "end_s": o.end_s,
                                "restored_s": o.restored_s, "ready_s": o.ready_s, "back_s": o.back_s}
                               for o in line.outages],
                  "endpoint_changes": [{"at_s": c.at_s, "url": c.url, "in_service": c.in_service,
                                        "breaker": c.breaker, "reason": c.reason} for c in line.changes],
                  "records_seen": len(line.records), "wall_s": wall_s}
    tables = _tables(a, line)
    report = build_report({"switchyard": list(results)}, title="switchyard bench: failover (chaos: region outages)",
                          workload=workload, parameters=parameters, seeds={"workload": ctx.options.seed},
                          tables=tables, goals=goals, notes=notes, extra_series={"switchyard": series})
    write_report(report, ctx.out_dir)
    return Outcome("failover", "ok", _summary(a), goals, tables[:4], "failover/report.md", notes=notes)
