"""The ``cache`` scenario's tables and goals, from :func:`~switchyard.bench.scenarios.cache.analysis.analyse`'s
figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from switchyard.bench.scenarios.cache.counters import BYTES, ENTRIES, FINISHED, GAUGE_REFRESH_S, LOOKUPS, STORES
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.figures import fixed, percent

GOAL_SPEEDUP = 10.0
GOAL_OF_BOUND = 0.9


def _hit_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Hit ratio against the repeat bound (cache arm)",
        [text("rule", "rule"), text("mode", "mode"), text("family", "requests of"), num("requests", "requests", 0),
         num("hits", "hits", 0), pct("hit_ratio", "hit %"), pct("bound", "repeat bound %"),
         pct("of_bound", "of the bound %"), pct("reachable", "reachable bound %"),
         pct("of_reachable", "of reachable %"), pct("exact_bound", "same wording before %"),
         num("paraphrase_hits", "paraphrase hits", 0), num("similarity_min", "similarity min", 3),
         num("similarity_p50", "similarity p50", 3), num("full_hits", "hits with full usage", 0),
         num("misses", "misses", 0), num("errors", "errors", 0),
         num("metrics_hits", "/metrics hits", 0), num("metrics_lookups", "/metrics lookups", 0),
         num("with_header", "with a cache header", 0)],
        rows,
        "Hits from each response's `x-switchyard-cache` header; `/metrics`: the gateway's "
        f"`{LOOKUPS}` deltas over the arm. *Repeat bound*: requests whose prompt (exact rule) or question in any "
        "wording (semantic rule) was sent before, in arrival order; *reachable*: those sent after an answer to it "
        "had completed (a repeat sent while the first answer is still being generated cannot hit); *same wording "
        "before*: the repeat fraction by exact text, what an exact cache could reach; *paraphrase hits*: hits whose "
        "wording had not been sent before; *hits with full usage*: hits whose usage reports the `max_tokens` every "
        "answer has (`ignore_eos`). The sampled requests (temperature > 0) must get no cache header at all.")


def _latency_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Latency: hits, misses and no cache",
        [text("arm", "arm"), text("requests", "requests"), text("stream", "stream"), num("n", "n", 0),
         ms("ttft_p50_s", "TTFT p50 ms", 1), ms("ttft_p99_s", "TTFT p99 ms", 1), ms("e2e_p50_s", "E2E p50 ms", 1),
         ms("e2e_p99_s", "E2E p99 ms", 1)],
        rows,
        "Cacheable (temperature 0) requests that succeeded; times from the scheduled send time. A whole (not "
        "streamed) answer's TTFT is its end-to-end time. *The same requests as the hits*: the no-cache arm's "
        "requests at the indices that hit in the cache arm (same schedule, same prompts' lengths).")


def _speedup_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "How many times faster a hit is",
        [text("stream", "stream"), text("against", "against"), num("hits", "hits", 0), num("others", "n", 0),
         ratio("ttft_p50_s", "TTFT p50 ÷"), ratio("ttft_p99_s", "TTFT p99 ÷"), ratio("e2e_p50_s", "E2E p50 ÷"),
         ratio("e2e_p99_s", "E2E p99 ÷")],
        rows, "The other requests' percentile divided by the hits' (above 1x: hits are faster).")


def _miss_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "What a miss pays for the lookup",
        [text("rule", "rule"), text("mode", "mode"), text("stream", "stream"), num("n", "misses", 0),
         ms("ttft_p50_s", "TTFT p50 ms", 1), ms("base_ttft_p50_s", "no cache: TTFT p50 ms", 1),
         ms("added_ttft_p50_s", "added ms", 1), ms("e2e_p50_s", "E2E p50 ms", 1),
         ms("base_e2e_p50_s", "no cache: E2E p50 ms", 1), ms("added_e2e_p50_s", "added ms", 1)],
        rows,
        "The cache arm's misses against the same requests in the no-cache arm. A semantic lookup embeds the last "
        "user turn before anything else (an embeddings request: the semantic hits' latency above is mostly that); "
        "the engines also carried more load in the no-cache arm (every request), which makes its side slower.")


def _engine_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Engine requests saved, and the cache at the end",
        [text("arm", "arm"), num("requests", "client requests", 0), num("ok", "ok", 0),
         num("engine_requests", "engine requests", 0), ratio("per_request", "engine / client"),
         num("saved", "saved vs no-cache", 0), num("hits", "hits (headers)", 0),
         num("metrics_hits", "hits (/metrics)", 0), num("metrics_lookups", "lookups (/metrics)", 0),
         num("stored", "stored", 0), num("not_stored", "not stored", 0), num("distinct", "distinct keys missed", 0),
         num("entries", "entries at the end", 0), num("bytes", "bytes at the end", 0),
         num("bytes_per_entry", "bytes / entry", 0)],
        rows,
        f"*Engine requests*: the generating engines' `{FINISHED}` deltas over the arm (embeddings are not "
        "counted); *saved*: the no-cache arm's less this arm's, which should equal the hits. *Stored*: "
        f"`{STORES}` deltas (every successful miss is offered; a repeat missed while its first answer was in "
        "flight stores the same key again); *distinct keys missed*: what the cache should hold; *entries*, "
        f"*bytes*: `{ENTRIES}`, `{BYTES}` after the arms (the gateway refreshes them every {GAUGE_REFRESH_S:g} s).")


def tables_of(a: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report's tables, in the order they appear: hits, speed-ups, latency, misses, engines."""
    return [_hit_table(a["hits"]), _speedup_table(a["speedup"]), _latency_table(a["latency"]),
            _miss_table(a["misses"]), _engine_table(a["engines"])]


def goals_of(a: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The scenario's goals from :func:`analyse`'s figures."""
    hits = {r["family"]: r for r in a["hits"]}
    speed = next(r for r in a["speedup"] if r["stream"] == "all" and r["against"] == "misses")
    lat = {(r["requests"], r["stream"]): r for r in a["latency"]}
    hit_all, miss_all = lat[("hits (all)", "all")], lat[("misses", "all")]
    value = speed["e2e_p50_s"]
    goals = [goal("hits vs misses, end-to-end p50", f"≥ {GOAL_SPEEDUP:g}x faster", value,
                  None if value is None else value >= GOAL_SPEEDUP, unit="x", decimals=1,
                  note=f"hits {fixed(hit_all['e2e_p50_s'], scale=1000, unit=' ms')} ({hit_all['n']}), misses "
                       f"{fixed(miss_all['e2e_p50_s'], scale=1000, unit=' ms')} ({miss_all['n']}); TTFT p50 ÷ "
                       f"{fixed(speed['ttft_p50_s'], unit='x')}")]
    for family, label in (("chat", "exact"), ("faq", "semantic")):
        row = hits[family]
        of = row["of_bound"]
        goals.append(goal(f"{label} hit ratio of its repeat bound", f"≥ {100 * GOAL_OF_BOUND:g}%", of,
                          None if of is None else of >= GOAL_OF_BOUND, unit="%", multiplier=100, decimals=1,
                          note=f"{row['hits']} hits of {row['requests']} requests ({percent(row['hit_ratio'])}); "
                               f"bound {percent(row['bound'])}, reachable {percent(row['reachable'])}"))
    cache_row = next(r for r in a["engines"] if r["arm"] == "cache")
    saved, hit_n = cache_row["saved"], cache_row["hits"]
    goals.append(goal("engine requests saved = hits", "= hits", saved, None if saved is None else saved == hit_n,
                      decimals=0, note=f"{hit_n} hits (headers), {cache_row['metrics_hits']:.0f} (/metrics); "
                      f"engines: {fixed(cache_row['engine_requests'], decimals=0)} requests with the cache"))
    return goals
