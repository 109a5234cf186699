"""The ``overload`` scenario's figures: per class and arm, SLO attainment, goodput, shed, downgrade and error
rates and TTFT; sheds by reason; what the gateway counted on its ``/metrics``; the report's tables."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from switchyard.bench.results import Outcome as RequestOutcome
from switchyard.bench.results import Result
from switchyard.bench.sampler import by_label
from switchyard.bench.scenarios.arms import capacity_table
from switchyard.bench.scenarios.overload.workload import (
    ARMS,
    BASELINE,
    CLASS_SHARE,
    CLASSES,
    MAIN_REPLICAS,
    MAX_NUM_SEQS,
    OVERLOAD,
    TENANTS,
)
from switchyard.bench.stats import Slo, slo_attainment, summarize
from switchyard.bench.tables import ms, num, pct, ratio, table, text

if TYPE_CHECKING:
    from switchyard.bench.scenarios.overload.scenario import Overload

SHED_CODES = ("shed_utilisation", "queue_deadline_exceeded", "queue_wait_too_long")


def downgraded(result: Result) -> bool:
    """Served by the downgrade model (the route header names the model it was downgraded from)."""
    return "downgraded_from" in result.route_fields


def shed_reason(result: Result) -> str | None:
    """Why a shed request (503) was refused: its error code (``503`` when it has none); None if not shed."""
    if result.outcome is not RequestOutcome.SHED:
        return None
    return result.error_code or "503"


def _rate(count: int, total: int) -> float | None:
    return count / total if total else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def class_rows(arms: Mapping[str, Sequence[Result]], slo: Mapping[str, Slo],
               window_s: float | None) -> list[dict[str, Any]]:
    """One row per class (and ``all``) and arm: attainment, goodput, shed/downgrade/error rates, TTFT."""
    rows = []
    for cls in (*CLASSES, "all"):
        for arm, results in arms.items():
            rs = [r for r in results if cls == "all" or r.request_class == cls]
            s = summarize(rs, slo=slo, window_s=window_s)
            n = len(rs)
            row: dict[str, Any] = {
                "class": cls, "arm": arm, "slo_ttft_s": slo[cls].ttft_s if cls in slo else None, "requests": n,
                "attainment": s.slo_attainment, "goodput_rps": s.goodput_rps, "goodput_tps": s.goodput_tps,
                "shed_rate": s.shed_rate, "downgrade_rate": _rate(sum(downgraded(r) for r in rs), n),
                "error_rate": _rate(s.errors + s.timeouts + s.limited, n), "timeout_rate": s.timeout_rate,
                "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
            }
            for kind, _ in TENANTS:
                mine = [r for r in rs if r.tenant.endswith(f"-{kind}")]
                row[f"{kind}_attainment"] = slo_attainment(mine, slo)
            rows.append(row)
    return rows


def ratio_rows(rows: Sequence[Mapping[str, Any]], arm: str = ARMS[0], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Per class: ``arm`` ÷ ``baseline`` of attainment, goodput and TTFT."""
    by = {(r["class"], r["arm"]): r for r in rows}
    out = []
    for cls in dict.fromkeys(r["class"] for r in rows):
        a, b = by.get((cls, arm)), by.get((cls, baseline))
        if a is None or b is None:
            continue
        out.append({"class": cls, **{key: _div(a[key], b[key]) for key in
                                     ("attainment", "goodput_rps", "goodput_tps", "ttft_p50_s", "ttft_p99_s")}})
    return out


def shed_rows(arms: Mapping[str, Sequence[Result]], gateway: Mapping[str, Mapping[str, Any]] | None = None
              ) -> list[dict[str, Any]]:
    """Per class and arm: sheds by reason, downgrades, and the gateway's own view (when scraped)."""
    rows = []
    for cls in CLASSES:
        for arm, results in arms.items():
            rs = [r for r in results if r.request_class == cls]
            reasons = Counter(shed_reason(r) for r in rs)
            seen = (gateway or {}).get(arm) or {}
            row: dict[str, Any] = {"class": cls, "arm": arm, "requests": len(rs),
                                   "shed": sum(n for reason, n in reasons.items() if reason is not None),
                                   "downgraded": sum(downgraded(r) for r in rs),
                                   "other_503": sum(n for reason, n in reasons.items()
                                                    if reason is not None and reason not in SHED_CODES),
                                   "gateway_shed": _counted(seen, "shed", cls),
                                   "gateway_downgrades": _counted(seen, "downgrades", cls),
                                   "queued": _counted(seen, "queued", cls),
                                   "queue_wait_mean_s": seen.get("queue_wait_mean_s", {}).get(cls)}
            for code in SHED_CODES:
                row[code] = reasons.get(code, 0)
            rows.append(row)
    return rows


def _counted(seen: Mapping[str, Any], key: str, cls: str) -> int | None:
    """A gateway counter of ``cls``: 0 when the gateway was read but never counted it, None when unread."""
    if not seen:
        return None
    value: int = seen.get(key, {}).get(cls, 0)
    return value


def gateway_view(metrics_text: str) -> dict[str, dict[str, Any]]:
    """What the gateway counted per class: sheds, downgrades, requests queued and their mean wait."""
    waited = by_label(metrics_text, "switchyard_queue_wait_seconds_sum", "class")
    queued = by_label(metrics_text, "switchyard_queue_wait_seconds_count", "class")
    return {"shed": {k: int(v) for k, v in by_label(metrics_text, "switchyard_shed_total", "class").items()},
            "downgrades": {k: int(v) for k, v in
                           by_label(metrics_text, "switchyard_downgrades_total", "class").items()},
            "queued": {k: int(v) for k, v in queued.items()},
            "queue_wait_mean_s": {k: waited.get(k, 0.0) / v for k, v in queued.items() if v}}


def _class_table(rows: Sequence[Mapping[str, Any]], o: Overload) -> dict[str, Any]:
    assert o.capacity is not None
    assert o.workload is not None
    return table(
        f"Per class at {OVERLOAD:g}x capacity: flow control on vs off",
        [text("class", "class"), text("arm", "arm"), ms("slo_ttft_s", "TTFT SLO ms", 0),
         num("requests", "requests", 0), pct("attainment", "SLO attainment %"),
         num("goodput_rps", "goodput req/s", 2), num("goodput_tps", "goodput tok/s", 0),
         pct("shed_rate", "shed %"), pct("downgrade_rate", "downgraded %"), pct("error_rate", "errors %"),
         pct("timeout_rate", "of which timeouts %"), ms("ttft_p50_s", "TTFT p50 ms", 0),
         ms("ttft_p99_s", "TTFT p99 ms", 0), pct("noisy_attainment", "noisy tenant attainment %"),
         pct("quiet_attainment", "quiet tenant attainment %")],
        rows,
        f"Offered {o.workload.offered_rate_per_s:.1f} requests/s for {o.duration_s:g} s ({OVERLOAD:g}x the measured "
        f"capacity of {o.capacity.rps:.1f} requests/s), classes "
        + "/".join(f"{100 * CLASS_SHARE[c]:g}" for c in CLASSES) + " %, each class's tenants noisy 75% / quiet 25%. "
        "Attainment: the share of *all* requests of the class that succeeded with their first token within the SLO "
        "(shed and failed requests miss it); goodput: those per second of the offered window. Errors: failures "
        f"other than a 503 shed, client timeouts ({o.timeout_s:g} s) included.")


def _ratio_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Flow control on ÷ off",
        [text("class", "class"), ratio("attainment", "SLO attainment ÷"), ratio("goodput_rps", "goodput req/s ÷"),
         ratio("goodput_tps", "goodput tok/s ÷"), ratio("ttft_p50_s", "TTFT p50 ÷"),
         ratio("ttft_p99_s", "TTFT p99 ÷")],
        rows, "Ratios of the figures above; '-' where the off arm's figure is 0 or missing.")


def _shed_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Shed and downgraded requests by reason",
        [text("class", "class"), text("arm", "arm"), num("requests", "requests", 0), num("shed", "shed (503)", 0),
         num("shed_utilisation", "above the threshold", 0), num("queue_deadline_exceeded", "queue deadline passed", 0),
         num("queue_wait_too_long", "predicted wait too long", 0), num("other_503", "other 503", 0),
         num("downgraded", "downgraded", 0), num("gateway_shed", "gateway: shed", 0),
         num("gateway_downgrades", "gateway: downgrades", 0), num("queued", "gateway: waited in queue", 0),
         ms("queue_wait_mean_s", "gateway: mean queue wait ms", 0)],
        rows, "Client side: the 503s by their error code, and the answers whose route header names "
        "`downgraded_from`. Gateway side: its `/metrics` at the end of the arm (`switchyard_shed`, "
        "`switchyard_downgrades`, `switchyard_queue_wait_seconds`).")


def _capacity_table(o: Overload) -> dict[str, Any]:
    assert o.workload is not None
    return capacity_table(
        o.arms, title="Capacity of the main pool (closed loop, before each arm's load)", tps_label="output tok/s",
        first_use=f"sets the offered rate ({OVERLOAD:g}x)",
        note=f"{MAIN_REPLICAS} replicas x --max-num-seqs {MAX_NUM_SEQS}: one client per sequence slot, calling the "
        f"engines directly, for {o.capacity_s:g} s after a {o.capacity_warmup_s:g} s warm-up, with requests of the "
        f"workload's lengths. Offered: {o.workload.offered_rate_per_s:.2f} requests/s ({len(o.workload)} requests, "
        f"Poisson, seed {o.ctx.options.seed}).")


def tables_of(o: Overload, rows: Sequence[Mapping[str, Any]],
              ratios: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The report's tables: per class and arm (``rows``, from :func:`class_rows`), on ÷ off (``ratios``), sheds
    by reason, and the capacity measured before each arm."""
    arms = {a.name: a.results for a in o.arms}
    sheds = shed_rows(arms, {a.name: a.gateway for a in o.arms})
    return [_class_table(rows, o), _ratio_table(ratios), _shed_table(sheds), _capacity_table(o)]
