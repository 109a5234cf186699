"""The ``cache`` scenario's figures from two arms: hits against the repeat bounds and the counters, latency of
hits, misses and the no-cache arm, speed-ups, what a miss pays, engine requests saved."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from switchyard.bench.results import Result
from switchyard.bench.scenarios.cache.counters import BASELINE, ArmRun, count
from switchyard.bench.scenarios.cache.workload import MODES, RULES, Family, reachable, repeat_bounds
from switchyard.bench.stats import percentiles


def _share(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def hit_rows(arm: ArmRun) -> list[dict[str, Any]]:
    """Per rule (and for the sampled requests and the whole workload): hits from the headers against the
    repeat bounds and the gateway's counters."""
    items, results, seen = arm.plan.items, arm.results, arm.seen
    bounds = repeat_bounds(items)
    lookups = arm.lookups
    rows: list[dict[str, Any]] = []
    total_hits = 0
    by: Literal["key", "group"]
    family: Family
    for family, by in (("chat", "key"), ("faq", "group")):
        rule = RULES[family]
        reach = reachable(results, items, by=by)
        mine = [r for r in results if items[r.index].family == family]
        hits = [r for r in mine if seen[r.index].hit]
        total_hits += len(hits)
        bound = bounds[family]
        best = bound.exact if family == "chat" else bound.semantic
        reach_n = sum(1 for r, ok in zip(results, reach, strict=True) if ok and items[r.index].family == family)
        sims = [s for s in (seen[r.index].similarity for r in hits) if s is not None]
        keys_before: set[str] = set()
        paraphrase_hits = 0
        for r in sorted(results, key=lambda r: r.index):
            item = items[r.index]
            if item.family == family and seen[r.index].hit and item.key not in keys_before:
                paraphrase_hits += 1
            keys_before.add(item.key)
        ratio_ = len(hits) / len(mine) if mine else None
        rows.append({
            "rule": rule, "mode": MODES[rule], "family": family, "requests": len(mine), "hits": len(hits),
            "hit_ratio": ratio_, "bound": best, "of_bound": _share(ratio_, best),
            "reachable": reach_n / len(mine) if mine else None,
            "of_reachable": _share(len(hits), reach_n) if reach_n else None,
            "exact_bound": bound.exact, "paraphrase_hits": paraphrase_hits if family == "faq" else None,
            "similarity_min": min(sims) if sims else None,
            "similarity_p50": percentiles(sims, (50,))["p50"] if sims else None,
            "misses": sum(seen[r.index].result == "miss" for r in mine), "full_hits": full_answers(hits),
            "errors": sum(seen[r.index].result == "error" for r in mine),
            "metrics_hits": count(lookups, rule=rule, result="hit"),
            "metrics_lookups": count(lookups, rule=rule)})
    sampled = [r for r in results if items[r.index].family == "sampled"]
    sampled_hits = sum(seen[r.index].hit for r in sampled)
    rows.append({"rule": "(none)", "mode": "-", "family": "sampled", "requests": len(sampled), "hits": sampled_hits,
                 "hit_ratio": sampled_hits / len(sampled) if sampled else None, "bound": 0.0 if sampled else None,
                 "with_header": sum(seen[r.index].result != "none" for r in sampled)})
    everything = bounds["all"]
    overall = total_hits / len(results) if results else None
    rows.append({"rule": "all", "mode": "-", "family": "all", "requests": len(results), "hits": total_hits,
                 "hit_ratio": overall, "bound": everything.exact, "of_bound": _share(overall, everything.exact),
                 "metrics_hits": count(lookups, result="hit"), "metrics_lookups": count(lookups)})
    return rows


def _latency(rs: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in rs if r.ok]
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99))
    e2e = percentiles([r.e2e_s for r in ok], (50, 99))
    return {"n": len(ok), "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "e2e_p50_s": e2e["p50"],
            "e2e_p99_s": e2e["p99"]}


STREAM_MODES: tuple[tuple[str, bool | None], ...] = (("streamed", True), ("whole", False), ("all", None))


def _mode(rs: Iterable[Result], stream: bool | None) -> list[Result]:
    return [r for r in rs if stream is None or r.stream == stream]


def latency_groups(cache: ArmRun, base: ArmRun) -> dict[str, tuple[str, list[Result]]]:
    """The requests each latency row is over, by name: (arm, results). Cacheable requests only."""
    items, seen = cache.plan.items, cache.seen
    cacheable = [r for r in cache.results if items[r.index].cacheable]
    hit_index = {r.index for r in cacheable if seen[r.index].hit}
    return {
        "hits (exact)": ("cache", [r for r in cacheable if seen[r.index].hit and seen[r.index].mode == "exact"]),
        "hits (semantic)": ("cache", [r for r in cacheable if seen[r.index].hit and seen[r.index].mode == "semantic"]),
        "hits (all)": ("cache", [r for r in cacheable if r.index in hit_index]),
        "misses": ("cache", [r for r in cacheable if not seen[r.index].hit]),
        "the same requests as the hits": (BASELINE, [r for r in base.results if r.index in hit_index]),
        "all cacheable": (BASELINE, [r for r in base.results if base.plan.items[r.index].cacheable]),
    }


def latency_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """TTFT and end-to-end p50/p99 of hits, misses and the no-cache arm, streamed and whole."""
    rows = []
    for name, (arm, rs) in latency_groups(cache, base).items():
        for mode, stream in STREAM_MODES:
            rows.append({"arm": arm, "requests": name, "stream": mode, **_latency(_mode(rs, stream))})
    return rows


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedup_rows(latency: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per stream mode: how many times faster hits were than misses, and than the same requests without
    the cache (p50 and p99 of TTFT and end-to-end)."""
    by = {(r["requests"], r["stream"]): r for r in latency}
    rows = []
    for mode, _ in STREAM_MODES:
        hit = by[("hits (all)", mode)]
        for against in ("misses", "the same requests as the hits"):
            other = by[(against, mode)]
            rows.append({"stream": mode, "against": against, "hits": hit["n"], "others": other["n"],
                         **{k: _div(other[k], hit[k]) for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
                                                                "e2e_p99_s")}})
    return rows


def miss_cost_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """Per rule and stream mode: a miss's latency against the same requests without the cache (what the lookup,
    and for a semantic rule the embedding, adds to a request the cache cannot answer)."""
    items, seen = cache.plan.items, cache.seen
    base_by = {r.index: r for r in base.results}
    rows = []
    for family in ("chat", "faq"):
        rule = RULES[family]
        misses = [r for r in cache.results if items[r.index].family == family and not seen[r.index].hit]
        for mode, stream in STREAM_MODES[:2]:
            ours = _latency(_mode(misses, stream))
            theirs = _latency([base_by[r.index] for r in _mode(misses, stream) if r.index in base_by])
            rows.append({"rule": rule, "mode": MODES[rule], "stream": mode, "n": ours["n"],
                         "ttft_p50_s": ours["ttft_p50_s"], "base_ttft_p50_s": theirs["ttft_p50_s"],
                         "added_ttft_p50_s": _minus(ours["ttft_p50_s"], theirs["ttft_p50_s"]),
                         "e2e_p50_s": ours["e2e_p50_s"], "base_e2e_p50_s": theirs["e2e_p50_s"],
                         "added_e2e_p50_s": _minus(ours["e2e_p50_s"], theirs["e2e_p50_s"])})
    return rows


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def full_answers(results: Iterable[Result]) -> int:
    """Successful answers whose usage reports ``max_tokens`` completion tokens (every request sends
    ``ignore_eos``, so an engine's answer has exactly that many, and so must a cached copy of it)."""
    return sum(1 for r in results if r.ok and r.completion_tokens == r.max_tokens)


def distinct_stored(arm: ArmRun) -> int:
    """Distinct cache keys among the arm's successful cacheable misses: the entries the cache should hold."""
    items = arm.plan.items
    return len({items[r.index].key for r in arm.results
                if r.ok and items[r.index].cacheable and arm.seen[r.index].result == "miss"})


def engine_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """Per arm: client requests, the engines' requests, those saved against the no-cache arm, hits, the
    gateway's lookups and stores, and (cache arm) the entries and bytes at the end."""
    saved_base = base.engine_requests
    rows = []
    for arm in (cache, base):
        stores = arm.stores
        engine = arm.engine_requests
        rows.append({
            "arm": arm.name, "requests": len(arm.results), "ok": sum(r.ok for r in arm.results),
            "engine_requests": engine, "per_request": _div(engine, float(len(arm.results))),
            "saved": saved_base - engine if saved_base is not None and engine is not None else None,
            "hits": sum(s.hit for s in arm.seen), "metrics_hits": count(arm.lookups, result="hit"),
            "metrics_lookups": count(arm.lookups), "stored": count(stores, result="stored"),
            "not_stored": count(stores) - count(stores, result="stored"),
            "distinct": distinct_stored(arm) if arm is cache else None,
            "entries": arm.after.entries if arm is cache else None,
            "bytes": arm.after.bytes if arm is cache else None,
            "bytes_per_entry": _div(arm.after.bytes, arm.after.entries) if arm is cache else None})
    return rows


def analyse(cache: ArmRun, base: ArmRun) -> dict[str, Any]:
    """Every figure of the run: hit ratios, latency, speed-ups, engine requests."""
    latency = latency_rows(cache, base)
    return {"hits": hit_rows(cache), "latency": latency, "speedup": speedup_rows(latency),
            "misses": miss_cost_rows(cache, base), "engines": engine_rows(cache, base)}
