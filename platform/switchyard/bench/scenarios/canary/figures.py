"""The ``canary`` scenario's figures (from the answers' route headers and the canaries' status), its tables, goals,
notes and summary line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from switchyard.bench.results import Result
from switchyard.bench.scenarios.canary.policy import LARGE_PRICE, SMALL_PRICE
from switchyard.bench.stats import percentiles
from switchyard.bench.tables import goal, ms, num, pct, table, text

if TYPE_CHECKING:
    from switchyard.bench.scenarios.canary.scenario import CanaryRun, Watched

#: The issue's goals for the bad candidate: rolled back within two minutes, having decided at most 2% of the
#: requests sent while it ran.
GOAL_DETECT_S = 120.0
GOAL_SHARE = 0.02
PRICES = {"small": SMALL_PRICE, "large": LARGE_PRICE}


def cost_of(result: Result) -> float | None:
    """What an answered request cost, in USD, at the price of the model its route header names."""
    price = PRICES.get(result.route_fields.get("model", ""))
    if price is None or not result.ok:
        return None
    prompt = result.prompt_tokens if result.prompt_tokens is not None else result.prompt_tokens_sent
    return (prompt * price[0] + result.output_tokens * price[1]) / 1e6


def _side(name: str, results: Sequence[Result]) -> dict[str, Any]:
    answered = [r for r in results if r.ok]
    ttft = [t for r in answered if (t := r.service_ttft_s) is not None]
    p = percentiles(ttft, (50, 99))
    costs = [c for r in answered if (c := cost_of(r)) is not None]
    large = sum(1 for r in answered if r.route_fields.get("model") == "large")
    return {"side": name, "requests": len(results), "ttft_p50_s": p["p50"], "ttft_p99_s": p["p99"],
            "cost_per_1k": 1000 * sum(costs) / len(costs) if costs else None,
            "on_large": large / len(answered) if answered else None}


def _canary(run: CanaryRun, w: Watched) -> dict[str, Any]:
    label = f"v{w.version}"
    start = w.started_at
    status = str(w.final.get("status", "running"))
    end = w.ended_at if w.ended_at is not None else (w.timeline[-1][0] if w.timeline else start)
    sent = [(run.wall_of(r), r) for r in run.results]
    life = [r for at, r in sent if start <= at < end]
    decided = [(at, r) for at, r in sent if r.route_fields.get("policy") == label]
    in_life = [r for at, r in decided if start <= at < end]
    after = [at - end for at, r in decided if at >= end]
    first = min((at for at, _ in decided), default=None)
    starts = sorted(w.step_starts.items())
    stages = w.plan.rollout["steps"]
    alpha = float(w.final.get("alpha") or w.started.get("alpha") or 0.001)
    steps = []
    for i, (number, began) in enumerate(starts):
        until = starts[i + 1][1] if i + 1 < len(starts) else end
        window = [r for at, r in sent if began <= at < until]
        mine = sum(1 for r in window if r.route_fields.get("policy") == label)
        tests = w.evidence.get(number) or []
        whole = [t for t in tests if t.get("class") == "*"]
        steps.append({"candidate": w.plan.label, "step": number, "percent": float(stages[number - 1]["percent"]),
                      "began_s": began - start, "lasted_s": until - began, "requests": len(window), "decided": mine,
                      "share": mine / len(window) if window else None, "tests": len(tests),
                      "n_tested": max((int(t["n_canary"]) for t in whole), default=None),
                      "least_p": min((float(t["p_value"]) for t in tests), default=None),
                      "alpha_each": alpha / len(tests) if tests else None})
    compared = []
    for side in ("canary", "control"):
        figures = ((w.final.get("figures") or {}).get("*") or {}).get(side) or {}
        compared.append({"candidate": w.plan.label, "side": "slice (candidate)" if side == "canary" else
                         "the rest (active version)", "requests": figures.get("requests"),
                         "ttft_p99_ms": figures.get("ttft_p99_ms"), "cost_per_1k": figures.get("cost_per_1k"),
                         "error_rate": figures.get("error_rate"),
                         "rate_limited_rate": figures.get("rate_limited_rate")})
    others = [r for r in life if r.route_fields.get("policy") not in (None, label)]
    client = [{"candidate": w.plan.label, **_side("slice (candidate)", in_life)},
              {"candidate": w.plan.label, **_side("the rest (active version)", others)}]
    return {
        "candidate": w.plan.label, "change": w.plan.change, "id": w.final.get("id"), "version": w.version,
        "base": w.started.get("base"), "status": status, "aborted": w.aborted, "reason": w.final.get("reason"),
        "rollout": w.plan.rollout, "started_at": start, "ended_at": w.ended_at,
        "duration_s": (w.ended_at - start) if w.ended_at is not None else None,
        "api_s": w.answered_at - w.sent_at,
        "percents_reached": [s["percent"] for s in steps],
        "requests_while_running": len(life), "decided_while_running": len(in_life),
        "share_while_running": len(in_life) / len(life) if life else None,
        "decided_total": len(decided), "decided_after_end": len(after), "last_after_end_s": max(after, default=None),
        "first_decided_s": (first - start) if first is not None else None,
        "unattributed_while_running": sum(1 for r in life if not r.route_fields.get("policy")),
        "steps": steps, "compared": compared, "client": client,
        "breaches": [g for g in w.final.get("guards_tested") or [] if g.get("breached")],
        "replicas": w.final.get("replicas"),
    }


def analyse(run: CanaryRun) -> dict[str, Any]:
    """Every figure of the run (JSON-ready)."""
    canaries = [_canary(run, w) for w in run.watched]
    failed: dict[str, int] = {}
    for r in run.results:
        if not r.ok:
            kind = f"{r.status or '-'} {r.error_type or ''}".strip()
            failed[kind] = failed.get(kind, 0) + 1
    return {"canaries": canaries, "requests": len(run.results), "failed": failed,
            "load_s": run.load_ended - run.load_began if run.load_ended else None}


def _by(f: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((c for c in f["canaries"] if c["candidate"] == label), None)


def tables_of(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's tables: the two canaries, their steps, the slice against the rest (as the canary compared
    them, and as the clients saw it)."""
    rows = [{"candidate": c["candidate"], "change": c["change"], "outcome": c["status"] + (" (aborted by the bench)"
                                                                                       if c["aborted"] else ""),
             "steps": " → ".join(f"{p:g}%" for p in c["percents_reached"]), "duration_s": c["duration_s"],
             "decided": c["decided_while_running"], "share": c["share_while_running"],
             "requests": c["requests_while_running"], "reason": c["reason"]} for c in f["canaries"]]
    canaries = table("The two canaries",
                     [text("candidate", "candidate"), text("change", "change"), text("outcome", "outcome"),
                      text("steps", "steps served"), num("duration_s", "start → end s", 1),
                      num("requests", "requests while it ran", 0), num("decided", "decided by the candidate", 0),
                      pct("share", "share decided by it %", 2), text("reason", "reason")],
                     rows, "Requests counted by their send time between the canary's start and its end (the status' "
                     "started_at and ended_at); 'decided by the candidate': the answer's x-switchyard-route names its "
                     "version (policy=vN).")
    steps = table("Steps",
                  [text("candidate", "candidate"), num("step", "step", 0), num("percent", "percent", 0),
                   num("began_s", "began s", 1), num("lasted_s", "lasted s", 1), num("requests", "requests", 0),
                   num("decided", "decided by the candidate", 0), pct("share", "share %", 2),
                   num("tests", "guard tests", 0), num("n_tested", "slice requests tested", 0),
                   text("least_p_text", "least p"), text("alpha_text", "alpha per test")],
                  [{**s, "least_p_text": _p(s["least_p"]), "alpha_text": _p(s["alpha_each"])}
                   for c in f["canaries"] for s in c["steps"]],
                  "A slice by tenant: its share of the traffic is that of the tenants whose hash falls under the "
                  "percent, not the percent itself. The tests: the guards a step passed on (the status' "
                  "passed_steps, from the audit log) or, for the step it ended in, those tested at its end; the "
                  "slice's requests in that step's window (which starts no earlier than the step) over all "
                  "classes, the least p-value and the per-test alpha (alpha shared among the tests).")
    compared = table("The slice against the rest, as the canary compared them (all classes, over its window in "
                     "its last step)",
                     [text("candidate", "candidate"), text("side", "side"), num("requests", "requests", 0),
                      num("ttft_p99_ms", "TTFT p99 ms", 1), num("cost_per_1k", "cost per 1,000 USD", 4),
                      pct("error_rate", "errors %", 2), pct("rate_limited_rate", "429 %", 2)],
                     [row for c in f["canaries"] for row in c["compared"]],
                     "From the canary's status at its end (GET /admin/api/policy/canary): both replicas' figures.")
    client = table("The slice against the rest, as the clients saw it (while the canary ran)",
                   [text("candidate", "candidate"), text("side", "side"), num("requests", "requests", 0),
                    ms("ttft_p50_s", "TTFT p50 ms", 1), ms("ttft_p99_s", "TTFT p99 ms", 1),
                    num("cost_per_1k", "cost per 1,000 USD", 4), pct("on_large", "on large %", 1)],
                   [row for c in f["canaries"] for row in c["client"]],
                   "TTFT from the send; cost from the answer's usage at the price of the model its route header names.")
    return [canaries, steps, compared, client]


def goals_of(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals."""
    good, bad = _by(f, "good"), _by(f, "bad")
    goals = []
    if good is not None:
        goals.append(goal("good candidate promoted through its steps", "promoted", good["duration_s"],
                          good["status"] == "promoted" and not good["aborted"], unit="s", decimals=1,
                          note=f"{good['status']}; steps {', '.join(f'{p:g}%' for p in good['percents_reached'])}"))
    if bad is not None:
        rolled = bad["status"] == "rolled_back"
        goals.append(goal("bad candidate rolled back automatically", "rolled back", bad["duration_s"] if rolled
                          else None, rolled, unit="s", decimals=1, note=f"{bad['status']}: {bad['reason'] or '-'}"))
        detect = bad["duration_s"] if rolled else None
        goals.append(goal("bad candidate: start → rollback", f"≤ {GOAL_DETECT_S:g} s", detect,
                          None if not rolled else detect is not None and detect <= GOAL_DETECT_S, unit="s",
                          decimals=1, note="from the canary's start to its end, as its status records them"))
        share = bad["share_while_running"]
        goals.append(goal("requests decided by the bad candidate", f"≤ {100 * GOAL_SHARE:g}%", share,
                          None if share is None else share <= GOAL_SHARE, unit="%", multiplier=100, decimals=2,
                          note=f"{bad['decided_while_running']} of {bad['requests_while_running']} sent while it ran; "
                               f"{bad['decided_after_end']} more after its end"))
    return goals


def notes_of(f: dict[str, Any], run: CanaryRun) -> list[str]:
    """What the report says about how the run was made."""
    from switchyard.bench.scenarios.canary import scenario as s  # (it imports this module)

    notes = [f"{run.rate:g} requests/s (open loop, Poisson) over {len(run.tenants)} tenants (even shares; tiers "
             "enterprise 10%, pro 30%, free 60%, each its own priority class) through two gateway replicas sharing "
             f"SQLite; 2 `h100-8b` engines (`small`) and 1 `h100-70b` (`large`) at time scale {run.time_scale:g}. "
             "Mix: 42.5% short answers, 42.5% short streams, 15% long-prompt streams (to `large` under the route).",
             f"Rollouts by tenant with the default guards (TTFT p99 ≤ 1.5x the rest's, cost per 1,000 requests ≤ "
             f"1.25x, error rate ≤ +1 point, shed and 429 rates ≤ +2 points) and alpha 0.001 (per evaluation, shared "
             f"among its tests); min_requests {run.min_requests}, window {s.WINDOW_S:g} s. Good candidate: "
             f"{_steps(run.good_steps)}; bad candidate: {_steps(run.bad_steps)}. Why: a step cannot pass before its "
             "slice has served min_requests, and the window is longer than the first step takes to gather them, so "
             "the guards have seen all of a step before it passes. A regression of about 2x (TTFT p99 and cost) needs "
             "60 to 90 slice requests to be rejected at alpha 0.001, more than a 1% slice gathers in two minutes: the "
             "first step passes on too little evidence to reject it (the Steps table's least p against alpha per "
             "test), and the 10% step rejects it within seconds. The share it decides is its first step's requests "
             "plus those seconds', over all sent meanwhile: a larger min_requests lengthens the first step, which "
             "lowers that share and delays the rollback; "
             f"{s.MIN_REQUESTS} keeps both within the goals at {s.RATE:g} requests/s ({s.QUICK_MIN_REQUESTS}, the "
             "least allowed, with --quick).",
             "The slice's share of the traffic is that of the tenants whose hash (salted with the canary's id) falls "
             "under the percent: with a few hundred tenants of even traffic, a 1% step holds one or two tenants, or "
             "none (a step whose slice gets no traffic holds until someone promotes or aborts the canary).",
             "No guard is tested before the slice has served min_requests in the window: at the first step that "
             "takes min_requests over the slice's rate (its tenants' rate), however large the regression."]
    if f["failed"]:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(f["failed"].items()))
        notes.append(f"Requests not answered completely: {kinds}.")
    for c in f["canaries"]:
        if c["unattributed_while_running"]:
            notes.append(f"{c['candidate']} candidate: {c['unattributed_while_running']} answers while it ran had no "
                         "route header (refusals): which version decided them is not known.")
    return notes


def _p(value: float | None) -> str | None:
    return None if value is None else f"{value:.2g}"


def _steps(steps: Sequence[tuple[float, float]]) -> str:
    return " → ".join(f"{p:g}% (hold {h:g} s)" for p, h in steps)


def summary_of(f: dict[str, Any]) -> str:
    """One line for the index."""
    good, bad = _by(f, "good"), _by(f, "bad")
    parts = []
    if good is not None:
        parts.append(f"good candidate {good['status']} in {_s(good['duration_s'])}")
    if bad is not None:
        parts.append(f"bad candidate {bad['status']} in {_s(bad['duration_s'])} after deciding "
                     f"{bad['decided_while_running']} requests ({100 * (bad['share_while_running'] or 0):.2f}% of "
                     f"{bad['requests_while_running']})")
    return "; ".join(parts)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"
