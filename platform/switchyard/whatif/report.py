"""The pre-publish replay's report: what changes between the active policy and a candidate.

:func:`compare_arms` turns two :class:`~switchyard.whatif.replay.ArmResult` into plain data
(``report.json``, and what the console's publish step shows); :func:`render_report` renders the
Markdown from that data alone, so the two cannot disagree.

When the candidate's arm replayed a canary (its candidate deciding the slice, the active version the rest),
the report's ``canary`` says which: how many requests the candidate decided, of how many in the canary's
scope, and the slice's own figures under both arms (:func:`canary_summary`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from switchyard.bench.spec import Workload
from switchyard.bench.tables import ms, num, render_table, table, text
from switchyard.decide.pick import Strategy
from switchyard.figures import NO_VALUE, fixed, percentile
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.whatif.canary import CanarySlice, ReplayCanary, Who
from switchyard.whatif.outcomes import ArmResult, ReplayOutcome
from switchyard.whatif.replay import replay_policy

SCHEMA = 2
#: Error codes of requests flow control shed (a 503 of the gateway's queues).
SHED_CODES = frozenset({"shed_utilisation", "queue_wait_too_long", "queue_deadline_exceeded"})
#: Most placement moves listed one by one (the rest are summed in one line).
TOP_MOVES = 15


def _served(outcomes: Iterable[ReplayOutcome]) -> list[ReplayOutcome]:
    return [o for o in outcomes if o.status == 200]


def arm_summary(arm: ArmResult) -> dict[str, Any]:
    """One arm's headline figures."""
    outcomes = arm.outcomes
    served = _served(outcomes)
    prompt = sum(o.prompt_tokens for o in served)
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    n = len(outcomes)
    return {
        "name": arm.name,
        "policy": arm.policy,
        "sha256": arm.sha256,
        "requests": n,
        "served": len(served),
        "statuses": {str(k): v for k, v in sorted(Counter(o.status for o in outcomes).items())},
        "cost": sum(o.cost for o in outcomes),
        "cost_per_1000": 1000 * sum(o.cost for o in outcomes) / n if n else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(o.cached_tokens for o in served),
        "prefix_cache_hit_ratio": sum(o.cached_tokens for o in served) / prompt if prompt else None,
        "output_tokens": sum(o.output_tokens for o in served),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "cache_hits": sum(1 for o in served if o.cache_hit),
        "response_cache_hit_ratio": sum(1 for o in served if o.cache_hit) / len(served) if served else None,
        "downgraded": sum(1 for o in served if o.downgraded_from is not None),
        "queued": sum(1 for o in outcomes if o.queued_s is not None),
        "queue_wait_p99_s": percentile([o.queued_s for o in outcomes if o.queued_s is not None], 99),
        "shed": sum(1 for o in outcomes if o.status == 503 and o.code in SHED_CODES),
        "codes": dict(sorted(Counter(o.code for o in outcomes if o.code is not None).items())),
        "simulated_s": arm.simulated_s,
        "wall_s": arm.wall_s,
        "speedup": arm.speedup,
    }


def placement_changes(base: Sequence[ReplayOutcome], cand: Sequence[ReplayOutcome]) -> dict[str, Any]:
    """How many requests change model, pool or region, and the most common moves."""
    model = pool = region = 0
    moves: Counter[tuple[str, str]] = Counter()
    for b, c in zip(base, cand, strict=True):
        model += b.model != c.model
        pool += b.pool != c.pool
        region += b.region != c.region
        if b.placement != c.placement:
            moves[(b.placement, c.placement)] += 1
    top = moves.most_common(TOP_MOVES)
    return {
        "requests": len(base),
        "model_changed": model,
        "pool_changed": pool,
        "region_changed": region,
        "any_changed": sum(moves.values()),
        "moves": [{"from": f, "to": t, "requests": k} for (f, t), k in top],
        "other_moves": sum(moves.values()) - sum(k for _, k in top),
    }


def _status_counts(outcomes: Iterable[ReplayOutcome], statuses: Iterable[int]) -> dict[int, int]:
    counts = Counter(o.status for o in outcomes)
    return {s: counts.get(s, 0) for s in statuses}


def refusals_by_tier(base: Sequence[ReplayOutcome], cand: Sequence[ReplayOutcome]) -> list[dict[str, Any]]:
    """Per tier (and the class it has under each policy): 429s, 503s and other refusals, both arms."""
    rows = []
    for tier in sorted({o.tier for o in base}):
        b = [o for o in base if o.tier == tier]
        c = [o for o in cand if o.tier == tier]
        bc, cc = _status_counts(b, (429, 503)), _status_counts(c, (429, 503))
        b_class, c_class = b[0].request_class, c[0].request_class
        rows.append({
            "tier": tier,
            "class": b_class if b_class == c_class else f"{b_class} → {c_class}",
            "requests": len(b),
            "active_429": bc[429], "candidate_429": cc[429],
            "active_503": bc[503], "candidate_503": cc[503],
            "active_other": sum(1 for o in b if o.status not in (200, 429, 503)),
            "candidate_other": sum(1 for o in c if o.status not in (200, 429, 503)),
        })
    return rows


def ttft_by_class(base: Sequence[ReplayOutcome], cand: Sequence[ReplayOutcome]) -> list[dict[str, Any]]:
    """TTFT p50/p99 per priority class under each policy (a request counts in its class of that policy)."""
    rows = []
    for cls in sorted({o.request_class for o in (*base, *cand)} - {"-"}):
        b = [o.ttft_s for o in _served(base) if o.request_class == cls and o.ttft_s is not None]
        c = [o.ttft_s for o in _served(cand) if o.request_class == cls and o.ttft_s is not None]
        rows.append({"class": cls, "active_served": len(b), "candidate_served": len(c),
                     "active_p50": percentile(b, 50), "candidate_p50": percentile(c, 50),
                     "active_p99": percentile(b, 99), "candidate_p99": percentile(c, 99)})
    return rows


def _part(arm: ArmResult, outcomes: list[ReplayOutcome]) -> ArmResult:
    return ArmResult(arm.name, arm.policy, arm.sha256, outcomes, arm.simulated_s, arm.wall_s, arm.not_modelled)


def canary_summary(base: ArmResult, cand: ArmResult) -> dict[str, Any]:
    """What a canary arm's candidate decided: the canary (candidate, slice, scope), how many requests it decided
    (``candidate_decided``) of those in its scope (``in_scope``) and of all (``requests``), and the slice's own
    figures under both arms (``slice``: the headline figures and placement changes of those requests alone)."""
    assert cand.canary is not None
    n = len(cand.outcomes)
    decided = {o.index for o in cand.outcomes if o.canary == "canary"}
    in_scope = sum(1 for o in cand.outcomes if o.canary is not None)
    b = [o for o in base.outcomes if o.index in decided]
    c = [o for o in cand.outcomes if o.index in decided]
    return {
        **cand.canary,
        "requests": n,
        "in_scope": in_scope,
        "candidate_decided": len(decided),
        "share": len(decided) / n if n else None,
        "share_of_scope": len(decided) / in_scope if in_scope else None,
        "slice": {"arms": [arm_summary(_part(base, b)), arm_summary(_part(cand, c))],
                  "changes": placement_changes(b, c)},
    }


def compare_arms(base: ArmResult, cand: ArmResult, workload: Mapping[str, Any]) -> dict[str, Any]:
    """The replay's report as plain data (with ``canary`` when the candidate's arm replayed a canary).

    Raises:
        ValueError: The arms did not replay the same requests.
    """
    if [o.index for o in base.outcomes] != [o.index for o in cand.outcomes]:
        raise ValueError("the two arms replayed different requests")
    b, c = base.outcomes, cand.outcomes
    report = {
        "schema": SCHEMA,
        "title": "switchyard policy replay",
        "workload": dict(workload),
        "arms": [arm_summary(base), arm_summary(cand)],
        "changes": placement_changes(b, c),
        "refusals": refusals_by_tier(b, c),
        "ttft": ttft_by_class(b, c),
        "not_modelled": list(cand.not_modelled),
    }
    if cand.canary is not None:
        report["canary"] = canary_summary(base, cand)
    return report


def replay_report(active: PolicySnapshot, candidate: PolicySnapshot, workload: Workload, *,
                  active_dir: Path | None = None, candidate_dir: Path | None = None,
                  strategy: Strategy = "prefix-aware", seed: int = 0, canary: CanarySlice | None = None,
                  who: Mapping[int, Who] | None = None) -> dict[str, Any]:
    """Replay ``workload`` through both policies and compare them (:func:`compare_arms`'s data).

    ``*_dir``: the folder a policy's relative ``sim_profile`` paths start from. ``canary``: the candidate's arm
    replays a canary instead: the candidate decides the requests of this slice and the active version the
    rest (``who``: who each request was, by index, as the gateway identified it; see
    :mod:`switchyard.whatif.canary`).

    Raises:
        FleetError: A pool of either policy cannot be simulated.
    """
    base = replay_policy(active, workload, name="active", base_dir=active_dir, strategy=strategy, seed=seed)
    if canary is None:
        cand = replay_policy(candidate, workload, name="candidate", base_dir=candidate_dir, strategy=strategy,
                             seed=seed)
    else:
        cand = replay_policy(active, workload, name="canary", base_dir=active_dir, strategy=strategy, seed=seed,
                             canary=ReplayCanary(candidate, canary, candidate_dir), who=who)
    return compare_arms(base, cand, workload.describe())


def _delta(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return NO_VALUE
    if a == 0:
        return "same" if b == 0 else "new"
    return f"{100 * (b - a) / a:+.1f}%"


#: The headline rows: (summary key, label, format: a format string or ``ms`` for seconds shown in ms).
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("served", "served", "{:.0f}"), ("cost_per_1000", "cost per 1,000 requests", "{:.4f}"),
    ("prefix_cache_hit_ratio", "prefix-cache hit ratio (prompt tokens)", "{:.1%}"),
    ("cache_hits", "answered from the response cache", "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 (ms)", "ms"), ("ttft_p99_s", "TTFT p99 (ms)", "ms"),
    ("queued", "queued by flow control", "{:.0f}"), ("queue_wait_p99_s", "queue wait p99 (ms)", "ms"),
    ("shed", "shed by flow control (503)", "{:.0f}"), ("downgraded", "downgraded to a cheaper model", "{:.0f}"),
)


def headline_rows(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """The headline figures of both arms, formatted, with the change (what Markdown and the console show)."""
    base, cand = report["arms"]
    rows = []
    for key, label, fmt in HEADLINE:
        a, b = base.get(key), cand.get(key)
        shown = [fixed(v, scale=1000) if fmt == "ms" else (NO_VALUE if v is None else fmt.format(v)) for v in (a, b)]
        rows.append({"figure": label, "active": shown[0], "candidate": shown[1], "change": _delta(a, b)})
    return rows


def _render_canary(canary: Mapping[str, Any], active: str) -> list[str]:
    """The canary section: who decided what, and the slice's own headline figures."""
    only = canary["only"]
    scope = "; ".join(f"{name} {', '.join(values)}" for name, values in only.items() if values)
    share = canary["share"]
    out = ["## Canary", "",
           f"**{canary['candidate']} decided {canary['candidate_decided']} of {canary['requests']} requests**"
           f" ({NO_VALUE if share is None else f'{share:.1%}'}): the slice of {canary['percent']:g}% by "
           f"{canary['by']} (salted with {canary['salt']}) of the {canary['in_scope']} requests in the canary's "
           f"scope ({scope or 'every request'}); {active} decided the rest.", ""]
    if canary.get("shadow"):
        out += ["The canary runs in shadow: the replay shows what its slice would meet if the candidate served it.",
                ""]
    if canary["candidate_decided"]:
        sliced = canary["slice"]
        rows = headline_rows({"arms": sliced["arms"]})
        moved = sliced["changes"]
        out += render_table(level=3, data=table("The slice alone", [
            text("figure", "figure"), text("active", active), text("candidate", canary["candidate"]),
            text("change", "change")], rows,
            f"{moved['any_changed']} of {moved['requests']} requests of the slice change placement."))
    return out


def render_report(report: Mapping[str, Any]) -> str:
    """``report.md`` of a replay, from :func:`compare_arms`'s data alone."""
    base, cand = report["arms"]
    wl = report["workload"]
    changes = report["changes"]
    out = [f"# Policy replay: {base['policy']} (active) vs {cand['policy']} (candidate)", "",
           f"{wl.get('requests', base['requests'])} requests from {wl.get('source', 'a workload')}"
           f" over {wl.get('duration_s', 0):.0f} s, replayed in simulated time: "
           f"{base['wall_s']:.1f} s and {cand['wall_s']:.1f} s of wall-clock time for "
           f"{base['simulated_s']:.0f} s and {cand['simulated_s']:.0f} s simulated.", ""]
    rows = headline_rows(report)
    out += render_table(level=2, data=table("Headline", [text("figure", "figure"), text("active", base["policy"]),
                                           text("candidate", cand["policy"]), text("change", "change")], rows))
    out += [f"**{changes['any_changed']} of {changes['requests']} requests change placement**: "
            f"{changes['model_changed']} change model, {changes['pool_changed']} change pool, "
            f"{changes['region_changed']} change region.", ""]
    if report.get("canary") is not None:
        out += _render_canary(report["canary"], base["policy"])
    if changes["moves"]:
        note = f"{changes['other_moves']} more requests move in other ways." if changes["other_moves"] else ""
        out += render_table(level=2, data=table("Moves", [text("from", "active"), text("to", "candidate"),
                                            num("requests", "requests", 0)], changes["moves"], note))
    out += render_table(level=2, data=table("Refusals per tier", [
        text("tier", "tier"), text("class", "class"), num("requests", "requests", 0),
        num("active_429", "429 active", 0), num("candidate_429", "429 candidate", 0),
        num("active_503", "503 active", 0), num("candidate_503", "503 candidate", 0),
        num("active_other", "other errors active", 0), num("candidate_other", "other errors candidate", 0),
    ], report["refusals"]))
    out += render_table(level=2, data=table("TTFT per class", [
        text("class", "class"), num("active_served", "served active", 0),
        num("candidate_served", "served candidate", 0),
        ms("active_p50", "p50 active (ms)", 1), ms("candidate_p50", "p50 candidate (ms)", 1),
        ms("active_p99", "p99 active (ms)", 1), ms("candidate_p99", "p99 candidate (ms)", 1),
    ], report["ttft"]))
    statuses = sorted(set(base["statuses"]) | set(cand["statuses"]))
    out += render_table(level=2, data=table("Statuses", [text("status", "status"), num("active", base["policy"], 0),
                                           num("candidate", cand["policy"], 0)],
                              [{"status": s, "active": base["statuses"].get(s, 0),
                                "candidate": cand["statuses"].get(s, 0)} for s in statuses]))
    codes = sorted(set(base["codes"]) | set(cand["codes"]))
    if codes:
        out += render_table(level=2, data=table("Error codes", [text("code", "code"), num("active", base["policy"], 0),
                                               num("candidate", cand["policy"], 0)],
                                  [{"code": c, "active": base["codes"].get(c, 0),
                                    "candidate": cand["codes"].get(c, 0)} for c in codes]))
    if report["not_modelled"]:
        out += ["## Not modelled", "", *[f"- {line}" for line in report["not_modelled"]], ""]
    out += [f"Active policy sha256 {base['sha256']}; candidate {cand['sha256']}.", ""]
    return "\n".join(out)

