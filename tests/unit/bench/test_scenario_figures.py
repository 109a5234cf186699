"""The pure parts of the scenarios: the prefix bound, overhead's latency, the cache scenario's workload and
figures (the failover analysis: ``test_failover.py``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from switchyard.bench.prompts import LiteralText, SynthText, block_key
from switchyard.bench.results import Result
from switchyard.bench.sampler import bucket_quantile, histogram_buckets
from switchyard.bench.scenarios import SCENARIOS
from switchyard.bench.scenarios.cache import analysis as cache_analysis
from switchyard.bench.scenarios.cache import counters as cache_counters
from switchyard.bench.scenarios.cache import questions as cache_questions
from switchyard.bench.scenarios.cache import report as cache_report
from switchyard.bench.scenarios.cache import workload as cache_workload
from switchyard.bench.scenarios.overhead import _shifted
from switchyard.bench.scenarios.overhead_figures import goals, lag_rows, service_latency, stall_rows
from switchyard.bench.scenarios.prefix import unbounded_bound
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.traces import mooncake
from switchyard.sim.embeddings import embed_text
from tests.unit.bench.helpers import result

DATA = Path(__file__).parent / "data"


def _workload(*prompts: SynthText | LiteralText) -> Workload:
    specs = tuple(RequestSpec(i, float(i), p, 4, Labels()) for i, p in enumerate(prompts))
    return Workload(specs, float(len(specs)), {"source": "test"})


def _blocks(*ids_tokens: tuple[int, int]) -> SynthText:
    return SynthText(tuple((block_key(b), n) for b, n in ids_tokens))


def test_the_bound_counts_leading_blocks_seen_before() -> None:
    w = _workload(_blocks((0, 64), (1, 64)),            # all new: 0 of 128
                  _blocks((0, 64), (1, 64), (2, 30)),   # 128 of 158
                  _blocks((0, 64), (3, 64), (1, 64)),   # block 3 is new, so block 1 after it cannot hit: 64
                  _blocks((0, 64), (2, 50)))            # block 2 was seen with 30 tokens only: 64 + 30
    hits, total = unbounded_bound(w)
    assert total == 128 + 158 + 192 + 114
    assert hits == 0 + 128 + 64 + 94


def test_the_bound_of_a_trace_replay_is_the_fraction_of_shared_prefix_tokens() -> None:
    w = mooncake(DATA / "mooncake_small.jsonl", block_tokens=512)
    hits, total = unbounded_bound(w)
    assert total == sum(s.prompt_tokens for s in w.specs)
    assert 0 < hits < total


def test_text_prompts_count_as_misses() -> None:
    assert unbounded_bound(_workload(LiteralText("hello there"), LiteralText("hello there"))) == (0, 4)


ENGINE = """\
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="stop"}} 0.0
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="length"}} {length}
vllm:request_success_total{{model_name="sim-8b",engine="0",finished_reason="abort"}} {abort}
vllm:num_requests_running{{model_name="sim-8b",engine="0"}} {running}
vllm:num_requests_waiting{{model_name="sim-8b",engine="0"}} 0.0
"""


def test_chaos_is_the_failover_scenario() -> None:
    assert SCENARIOS["chaos"] is SCENARIOS["failover"] and SCENARIOS["chaos"].name == "failover"


def test_overhead_latency_is_from_send_and_the_warmup_is_cut_off() -> None:
    r = result(0, scheduled=2.0, late=0.5, ttft=0.7, e2e=0.9)
    assert service_latency(r, stream=True) == pytest.approx(0.2)
    assert service_latency(r, stream=False) == pytest.approx(0.4)
    assert service_latency(result(1, status=500), stream=False) is None
    shifted = _shifted(r, 1.0)
    assert (shifted.scheduled_s, shifted.sent_s, shifted.first_token_s, shifted.done_s) == \
        pytest.approx((1.0, 1.5, 1.7, 1.9))


# --- cache -----------------------------------------------------------------------------------------------


def test_every_wording_of_a_faq_question_is_a_semantic_match_and_no_two_questions_are() -> None:
    qs = cache_questions.faq_questions(30, seed=5)
    assert qs == cache_questions.faq_questions(30, seed=5)  # the same for a seed
    assert len(qs.questions) == 30 and len({q.wordings[0] for q in qs.questions}) == 30
    vectors = [[embed_text(w) for w in q.wordings] for q in qs.questions]
    within = min(cache_questions.cosine(a, b) for vs in vectors for a in vs for b in vs)
    across = max(cache_questions.cosine(a, b) for i, vs in enumerate(vectors) for other in vectors[i + 1:]
                 for a in vs for b in other)
    assert within >= cache_questions.PARAPHRASE_FLOOR > cache_questions.MIN_SIMILARITY
    assert across < cache_questions.CROSS_LIMIT < cache_questions.MIN_SIMILARITY
    assert qs.paraphrase_min == pytest.approx(within) and qs.cross_max == pytest.approx(across)
    for q in qs.questions:
        assert q.wordings[0] == cache_questions.rewordings(q.wordings[0])[0] and len(q.wordings) >= 3
        assert set(q.wordings) <= set(cache_questions.rewordings(q.wordings[0]))
    assert sum(5 - len(q.wordings) for q in qs.questions) == qs.dropped


def test_rewordings_change_case_punctuation_and_politeness_only() -> None:
    assert cache_questions.rewordings("How do I reset the password on my router?") == [
        "How do I reset the password on my router?", "how do i reset the password on my router",
        "Please, how do I reset the password on my router?", "How do I reset the password on my router? Thanks!",
        "Could you tell me: how do I reset the password on my router?"]


def test_zipf_weights_fall_with_rank() -> None:
    w = cache_workload.zipf_weights(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w.tolist() == pytest.approx([1 / x / (1 + 1 / 2 + 1 / 3 + 1 / 4) for x in (1, 2, 3, 4)])
    with pytest.raises(ValueError, match="at least one item"):
        cache_workload.zipf_weights(0)


def test_the_cache_workload_repeats_prompts_and_questions_with_fixed_parameters() -> None:
    qs = cache_questions.faq_questions(10, seed=1)
    plan = cache_workload.build_workload(rate_per_s=40.0, duration_s=10.0, seed=1, questions=qs)
    other = cache_workload.build_workload(rate_per_s=40.0, duration_s=10.0, seed=1, questions=qs, salt="b")
    specs, items = plan.workload.specs, plan.items
    assert len(specs) == len(items) > 300 and other.items == items
    bodies: dict[str, set[str]] = {}
    for spec, twin, item in zip(specs, other.workload.specs, items, strict=True):
        body = spec.body()
        assert (twin.arrival_s, twin.max_tokens, twin.stream, twin.prompt_tokens) == \
            (spec.arrival_s, spec.max_tokens, spec.stream, spec.prompt_tokens)
        assert (twin.prompt.text() == spec.prompt.text()) == (item.family == "faq")  # the salt changes chat texts
        assert body["temperature"] == (0 if item.cacheable else cache_workload.SAMPLED_TEMPERATURE)
        assert body["model"] == {"chat": "chat", "faq": "faq", "sampled": "chat"}[item.family]
        if item.cacheable:  # a repeat is the very same request but for streaming
            body.pop("stream", None)
            body.pop("stream_options", None)
            bodies.setdefault(item.key, set()).add(repr(sorted(body.items())))
        if item.family == "faq":
            question = qs.questions[int(item.group.split(":")[1])]
            assert spec.prompt.text() in question.wordings and spec.max_tokens == question.max_tokens
            assert item.paraphrase == (spec.prompt.text() != question.wordings[0])
    assert all(len(b) == 1 for b in bodies.values())
    families = Counter(i.family for i in items)
    assert families["chat"] > families["faq"] > families["sampled"] > 0
    assert 0.5 < sum(s.stream for s in specs) / len(specs) < 0.9
    faq = [i for i in items if i.family == "faq"]
    assert 0.3 < sum(i.paraphrase for i in faq) / len(faq) < 0.7


def _item(family: str, key: str, group: str | None = None) -> cache_workload.Item:
    return cache_workload.Item(family, key, group or key, family != "sampled",  # type: ignore[arg-type]
                               paraphrase=family == "faq" and not key.endswith(":0"))


ITEMS = (_item("chat", "chat:1"), _item("faq", "faq:1:0", "faq:1"), _item("chat", "chat:1"),
         _item("faq", "faq:1:2", "faq:1"), _item("sampled", "sampled:4"), _item("chat", "chat:2"),
         _item("faq", "faq:1:2", "faq:1"), _item("chat", "chat:1"))


def test_repeat_bounds_count_earlier_keys_and_questions() -> None:
    b = cache_workload.repeat_bounds(ITEMS)
    assert (b["chat"].requests, b["chat"].repeats) == (4, 2) and b["chat"].exact == 0.5
    assert (b["faq"].requests, b["faq"].repeats, b["faq"].group_repeats) == (3, 1, 2)
    assert b["faq"].semantic == pytest.approx(2 / 3) and b["faq"].exact == pytest.approx(1 / 3)
    assert b["sampled"].repeats == 0 and b["sampled"].requests == 1
    assert (b["all"].requests, b["all"].repeats) == (8, 4)
    assert cache_workload.repeat_bounds([])["all"].exact is None


def _cached(i: int, sent: float, e2e: float, *, ttft: float | None = None, stream: bool = True,
            arm: str = "cache", status: int = 200) -> Result:
    r = result(i, arm=arm, cls=ITEMS[i].family, scheduled=sent, ttft=ttft if ttft is not None else e2e, e2e=e2e,
               status=status)
    r.stream = stream
    r.max_tokens = 10 if i != 6 else 11
    return r


HIT_EXACT = "hit; rule=exact; mode=exact"
MISS_EXACT = "miss; rule=exact; mode=exact"
HEADERS = (MISS_EXACT, "miss; rule=faq; mode=semantic", HIT_EXACT, "hit; rule=faq; mode=semantic; similarity=0.910",
           None, MISS_EXACT, "hit; rule=faq; mode=semantic; similarity=1.000", MISS_EXACT)


def _arms() -> tuple[cache_counters.ArmRun, cache_counters.ArmRun]:
    qs = cache_questions.QuestionSet((), 1.0, 0.0, 0)
    plan = cache_workload.CacheWorkload(Workload((), 10.0, {"source": "test"}), ITEMS, qs)
    cache = cache_counters.ArmRun("cache", plan)
    # request 7 repeats chat:1 while request 0's answer is still being generated: a miss, and not reachable.
    cache.results = [_cached(0, 0.0, 8.0, ttft=0.03), _cached(1, 1.0, 0.5, stream=False),
                     _cached(2, 9.0, 0.002, ttft=0.001), _cached(3, 2.0, 0.02, ttft=0.015),
                     _cached(4, 3.0, 0.4, ttft=0.03), _cached(5, 4.0, 0.3, ttft=0.02, stream=False),
                     _cached(6, 5.0, 0.03, stream=False), _cached(7, 6.0, 0.6, ttft=0.04)]
    cache.seen = [cache_counters.parse_cache_header(h) for h in HEADERS]
    base = cache_counters.ArmRun(cache_counters.BASELINE, plan)
    base.results = [_cached(r.index, r.scheduled_s, 0.5, ttft=0.04, stream=r.stream, arm="no-cache")
                    for r in cache.results]
    base.seen = [cache_counters.Seen() for _ in ITEMS]
    cache.before = cache_counters.read_counters(CACHE_METRICS.format(hit=0, miss=0, faq_hit=0, faq_miss=0,
                                                                     stored=0), [ENGINE.format(length=5, abort=0,
                                                                                               running=0)])
    cache.after = cache_counters.read_counters(CACHE_METRICS.format(hit=1, miss=3, faq_hit=2, faq_miss=1, stored=4),
                                               [ENGINE.format(length=10, abort=0, running=1)])
    base.before = cache_counters.read_counters(None, [ENGINE.format(length=10, abort=0, running=0)])
    base.after = cache_counters.read_counters(None, [ENGINE.format(length=18, abort=0, running=0)])
    return cache, base


CACHE_METRICS = """\
# TYPE switchyard_cache_lookups_total counter
switchyard_cache_lookups_total{{rule="exact",mode="exact",result="hit"}} {hit}
switchyard_cache_lookups_total{{rule="exact",mode="exact",result="miss"}} {miss}
switchyard_cache_lookups_total{{rule="faq",mode="semantic",result="hit"}} {faq_hit}
switchyard_cache_lookups_total{{rule="faq",mode="semantic",result="miss"}} {faq_miss}
switchyard_cache_lookups_created{{rule="faq",mode="semantic",result="miss"}} 1.7e9
# TYPE switchyard_cache_stores_total counter
switchyard_cache_stores_total{{rule="exact",mode="exact",result="stored"}} {stored}
switchyard_cache_stores_total{{rule="faq",mode="semantic",result="incomplete"}} 1.0
# TYPE switchyard_cache_entries gauge
switchyard_cache_entries 3.0
# TYPE switchyard_cache_bytes gauge
switchyard_cache_bytes 3000.0
"""


def test_cache_headers_are_parsed() -> None:
    seen = cache_counters.parse_cache_header("hit; rule=faq; mode=semantic; similarity=0.930")
    assert seen == cache_counters.Seen("hit", "faq", "semantic", 0.93) and seen.hit
    assert cache_counters.parse_cache_header("bypass; rule=exact; mode=exact; store=no").result == "bypass"
    assert cache_counters.parse_cache_header(None) == cache_counters.Seen("none") and not cache_counters.Seen().hit
    assert cache_counters.parse_cache_header("hit; rule=faq; similarity=x").similarity is None


def test_cache_counters_are_read_from_the_gateway_and_the_engines() -> None:
    cache, base = _arms()
    assert cache.lookups == {("exact", "exact", "hit"): 1, ("exact", "exact", "miss"): 3,
                             ("faq", "semantic", "hit"): 2, ("faq", "semantic", "miss"): 1}
    assert cache.stores == {("exact", "exact", "stored"): 4}  # the incomplete one did not grow
    assert cache_counters.count(cache.lookups, rule="faq") == 3
    assert cache_counters.count(cache.lookups, result="hit") == 3
    assert (cache.after.entries, cache.after.bytes) == (3.0, 3000.0)
    assert cache.engine_requests == 5 and base.engine_requests == 8
    assert base.after.entries is None and base.lookups == {}
    assert cache_counters.read_counters("x 1\n", [None]).engine_finished is None


def test_reachable_repeats_need_an_answer_completed_before_they_were_sent() -> None:
    cache, _ = _arms()
    by_key = cache_workload.reachable(cache.results, ITEMS, by="key")
    # chat:1 first completes at 8.0: request 2 (sent at 9.0) could hit, request 7 (6.0) could not.
    assert by_key == [False, False, True, False, False, False, True, False]
    by_group = cache_workload.reachable(cache.results, ITEMS, by="group")
    assert by_group[3] and by_group[6] and not by_group[1]


def test_cache_hit_rows_against_the_bounds_and_the_counters() -> None:
    cache, _ = _arms()
    rows = {r["family"]: r for r in cache_analysis.hit_rows(cache)}
    chat, faq, sampled, everything = rows["chat"], rows["faq"], rows["sampled"], rows["all"]
    assert (chat["requests"], chat["hits"], chat["misses"]) == (4, 1, 3)
    assert chat["hit_ratio"] == 0.25 and chat["bound"] == 0.5 and chat["of_bound"] == 0.5
    assert chat["reachable"] == 0.25 and chat["of_reachable"] == 1.0
    assert chat["metrics_hits"] == 1 and chat["metrics_lookups"] == 4
    assert (faq["hits"], faq["bound"], faq["exact_bound"]) == (2, pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert faq["of_bound"] == pytest.approx(1.0) and faq["paraphrase_hits"] == 1  # request 3's wording was new
    assert faq["similarity_min"] == 0.91 and faq["similarity_p50"] == pytest.approx(0.955)
    assert sampled["hits"] == 0 and sampled["with_header"] == 0
    assert chat["full_hits"] == 1 and faq["full_hits"] == 1  # request 6 reports 10 of its 11 tokens
    assert everything["hits"] == 3 and everything["hit_ratio"] == 3 / 8 and everything["of_bound"] == 0.75
    assert everything["metrics_hits"] == 3 and everything["metrics_lookups"] == 7


def test_cache_latency_compares_hits_with_misses_and_the_same_requests_without_the_cache() -> None:
    cache, base = _arms()
    groups = cache_analysis.latency_groups(cache, base)
    assert [r.index for r in groups["hits (exact)"][1]] == [2]
    assert [r.index for r in groups["hits (semantic)"][1]] == [3, 6]
    assert [r.index for r in groups["misses"][1]] == [0, 1, 5, 7]  # the sampled request is not cacheable
    assert groups["the same requests as the hits"][0] == "no-cache"
    assert [r.index for r in groups["the same requests as the hits"][1]] == [2, 3, 6]
    rows = {(r["requests"], r["stream"]): r for r in cache_analysis.latency_rows(cache, base)}
    hits = rows[("hits (all)", "all")]
    assert hits["n"] == 3 and hits["e2e_p50_s"] == pytest.approx(0.02)
    assert rows[("hits (all)", "streamed")]["ttft_p50_s"] == pytest.approx(0.008)
    assert rows[("misses", "whole")]["n"] == 2 and rows[("misses", "all")]["e2e_p50_s"] == pytest.approx(0.55)
    speed = {(r["stream"], r["against"]): r for r in cache_analysis.speedup_rows(list(rows.values()))}
    misses = {(r["rule"], r["stream"]): r for r in cache_analysis.miss_cost_rows(cache, base)}
    assert misses[("exact", "streamed")]["n"] == 2 and misses[("exact", "whole")]["n"] == 1
    assert misses[("exact", "streamed")]["ttft_p50_s"] == pytest.approx(0.035)
    assert misses[("exact", "streamed")]["added_ttft_p50_s"] == pytest.approx(0.035 - 0.04)
    assert misses[("faq", "whole")]["added_e2e_p50_s"] == pytest.approx(0.0)
    assert misses[("faq", "streamed")]["n"] == 0 and misses[("faq", "streamed")]["added_ttft_p50_s"] is None
    assert speed[("all", "misses")]["e2e_p50_s"] == pytest.approx(0.55 / 0.02)
    assert speed[("all", "the same requests as the hits")]["e2e_p50_s"] == pytest.approx(0.5 / 0.02)
    assert speed[("whole", "misses")]["hits"] == 1 and speed[("whole", "misses")]["others"] == 2


def test_cache_engine_requests_saved_and_the_goals() -> None:
    cache, base = _arms()
    rows = cache_analysis.engine_rows(cache, base)
    ours, theirs = rows
    assert ours["arm"] == "cache" and ours["engine_requests"] == 5 and ours["saved"] == 3 and ours["hits"] == 3
    assert ours["distinct"] == 3  # chat:1 (missed twice: the second while the first was in flight), faq:1:0, chat:2
    assert theirs["saved"] == 0 and theirs["entries"] is None and theirs["per_request"] == 1.0
    goals = {g["goal"]: g for g in cache_report.goals_of(cache_analysis.analyse(cache, base))}
    speed = goals["hits vs misses, end-to-end p50"]
    assert speed["value"] == pytest.approx(0.55 / 0.02) and speed["met"]
    assert goals["exact hit ratio of its repeat bound"]["value"] == 0.5
    assert goals["exact hit ratio of its repeat bound"]["met"] is False
    assert goals["semantic hit ratio of its repeat bound"]["met"] is True
    saved = goals["engine requests saved = hits"]
    assert saved["value"] == 3 and saved["met"] is True


def test_trace_repeats_count_whole_hash_id_lists_seen_before(tmp_path: Path) -> None:
    assert cache_workload.trace_repeats(DATA / "mooncake_small.jsonl") == (4, 0)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"hash_ids": ids}) for ids in ([1, 2], [1, 2, 3], [1, 2], [4], [1, 2]))
                     + "\n")
    assert cache_workload.trace_repeats(trace) == (5, 2)
    assert cache_workload.public_repeats(trace)[0] == "t.jsonl: 2 of 5 rows (40.0%)"


def test_the_batch_scenario_names_the_policys_default_batch_ceiling_and_reserve() -> None:
    from switchyard.bench.scenarios.batch.workload import DEFAULT_BATCH_CEILING, DEFAULT_BATCH_RESERVE, batch_policy
    from switchyard.policy import compile_policy

    snapshot = compile_policy(batch_policy([9001, 9002]))
    assert snapshot.document.priorities["batch"].dispatch_ceiling == DEFAULT_BATCH_CEILING
    assert snapshot.pools["main"].batch_reserve_slots == DEFAULT_BATCH_RESERVE


LAG = """\
# TYPE switchyard_event_loop_lag_seconds histogram
switchyard_event_loop_lag_seconds_bucket{{le="0.001"}} {a}
switchyard_event_loop_lag_seconds_bucket{{le="0.002"}} {b}
switchyard_event_loop_lag_seconds_bucket{{le="0.01"}} {c}
switchyard_event_loop_lag_seconds_bucket{{le="+Inf"}} {d}
switchyard_event_loop_lag_seconds_count {d}
switchyard_event_loop_lag_seconds_sum 0.5
"""


GC = """\
switchyard_gc_pause_seconds_bucket{{generation="{g}",le="0.001"}} {a}
switchyard_gc_pause_seconds_bucket{{generation="{g}",le="0.002"}} {b}
switchyard_gc_pause_seconds_bucket{{generation="{g}",le="0.01"}} {c}
switchyard_gc_pause_seconds_bucket{{generation="{g}",le="+Inf"}} {d}
"""


def test_a_histograms_quantile_between_two_scrapes_is_a_bucket_bound() -> None:
    before = histogram_buckets(LAG.format(a=100, b=100, c=100, d=100), "switchyard_event_loop_lag_seconds")
    after = histogram_buckets(LAG.format(a=1050, b=1090, c=1099, d=1100), "switchyard_event_loop_lag_seconds")
    assert after == {0.001: 1050.0, 0.002: 1090.0, 0.01: 1099.0, float("inf"): 1100.0}
    assert bucket_quantile(before, after, 0.5) == (0.001, 1000)
    assert bucket_quantile(before, after, 0.99) == (0.002, 1000)  # 990 of 1000 within 2 ms
    assert bucket_quantile(before, after, 0.995) == (0.01, 1000)
    assert bucket_quantile(before, after, 0.9995) == (float("inf"), 1000)
    assert bucket_quantile(after, after, 0.99) == (None, 0)
    assert histogram_buckets("", "switchyard_event_loop_lag_seconds") == {}


def test_a_missed_latency_goal_names_the_loops_lag_and_the_hosts_jitter() -> None:
    gc_text = (GC.format(g=0, a=10, b=300, c=300, d=300) + GC.format(g=1, a=0, b=0, c=0, d=0)
               + GC.format(g=2, a=0, b=0, c=2, d=2))
    before = {"lag": histogram_buckets(LAG.format(a=0, b=0, c=0, d=0), "switchyard_event_loop_lag_seconds"),
              "gc0": {}, "gc1": {}, "gc2": {}}
    after = {"lag": histogram_buckets(LAG.format(a=900, b=950, c=999, d=1000), "switchyard_event_loop_lag_seconds")}
    for g in range(3):
        after[f"gc{g}"] = histogram_buckets(gc_text, "switchyard_gc_pause_seconds", f'generation="{g}",')
    lag = lag_rows(SimpleNamespace(lag={"stream": [(before, after)]}))  # type: ignore[arg-type]
    assert lag == [{"mode": "stream", "checks": 1000, "late_share": pytest.approx(0.05), "p99_bucket_s": 0.01,
                    "p999_bucket_s": 0.01, "gc0": 300, "gc0_max_bucket_s": 0.002, "gc1": 0,
                    "gc1_max_bucket_s": None, "gc2": 2, "gc2_max_bucket_s": 0.01}]
    latency = [{"mode": "stream", "rate": 500.0, "arm": "direct", "p50_s": 0.0011, "p99_s": 0.0052},
               {"mode": "stream", "rate": 500.0, "arm": "switchyard", "added_p99_s": 0.0061},
               {"mode": "non-stream", "rate": 500.0, "arm": "switchyard", "added_p99_s": 0.0015}]
    non_stream, stream = (g for g in goals(latency, [], lag) if "p99 added latency at 500" in g["goal"])
    assert stream["met"] is False and non_stream["met"] is True
    assert non_stream["note"] == ""
    assert stream["note"] == (
        "In the way: the gateway's event loop ran a 10 ms timer more than 2 ms late in 5.0% of 1000 checks (p99 ≤ "
        "10 ms, p99.9 ≤ 10 ms): a request arriving then waits as long; garbage collections stopped it meanwhile: "
        "300 of generation 0 (each ≤ 2 ms), 2 of generation 2 (each ≤ 10 ms); the engine called directly jitters "
        "too (p50 1.10 ms, p99 5.20 ms): the host's scheduling, which the gateway's process meets as well.")


def test_stalls_are_grouped_by_where_the_loop_thread_was() -> None:
    lines = ["2026-11-30 22:00:01 WARNING switchyard.stalls: event loop stalled 12.5 ms at a.py:1 f < b.py:2 g",
             "2026-11-30 22:00:02 WARNING switchyard.stalls: event loop stalled 30.0 ms at a.py:1 f < c.py:3 h",
             "2026-11-30 22:00:03 WARNING switchyard.stalls: event loop stalled 6.0 ms at selectors.py:9 select",
             "an unrelated line"]
    rows = stall_rows(lines)
    assert [(r["where"], r["stalls"]) for r in rows] == [("a.py:1 f", 2), ("selectors.py:9 select", 1)]
    assert rows[0]["total_s"] == pytest.approx(0.0425) and rows[0]["longest_s"] == pytest.approx(0.03)
    assert rows[0]["stack"] == "a.py:1 f < c.py:3 h"
    latency = [{"mode": "stream", "rate": 500.0, "arm": "switchyard", "added_p99_s": 0.01}]
    [stream] = [g for g in goals(latency, [], [], rows) if "(stream, first chunk)" in g["goal"]]
    assert stream["note"].endswith("a stall sampler in an uncounted step found the loop thread most often at "
                                   "a.py:1 f (2 stalls, 42 ms; see the stall table).")


def test_a_stall_inside_the_event_loop_itself_is_said_so() -> None:
    rows = stall_rows(["x WARNING switchyard.stalls: event loop stalled 8.0 ms at 3.11/asyncio/runners.py:118 run "
                       "< uvicorn/server.py:86 run"])
    latency = [{"mode": "stream", "rate": 500.0, "arm": "switchyard", "added_p99_s": 0.01}]
    [stream] = [g for g in goals(latency, [], [], rows) if "(stream, first chunk)" in g["goal"]]
    assert "3.11/asyncio/runners.py:118 run (inside the event loop itself: no Python callback was running" in \
        stream["note"]


def test_the_overhead_goals_are_the_hot_paths() -> None:
    latency = [{"mode": "non-stream", "rate": 500.0, "arm": "switchyard", "added_p50_s": 0.0004, "added_p99_s": 0.003},
               {"mode": "non-stream", "rate": 1000.0, "arm": "switchyard", "added_p99_s": 0.0049},
               {"mode": "stream", "rate": 500.0, "arm": "switchyard", "added_p99_s": 0.0019}]
    saturation = [{"mode": "non-stream", "arm": "switchyard", "rps": 3100.0, "vs_litellm": 24.0, "note": "proxy-bound"},
                  {"mode": "stream", "arm": "switchyard", "rps": 1900.0, "vs_litellm": 30.0,
                   "note": "load-generator-bound: the proxy had CPU to spare"},
                  {"mode": "non-stream", "arm": "litellm", "rps": 129.0},
                  {"mode": "stream", "arm": "litellm", "rps": 63.0}]
    found = {g["goal"]: g for g in goals(latency, saturation)}
    verdicts = {name: (g["target"], g["met"]) for name, g in found.items()}
    assert verdicts == {
        "gateway p99 added latency at 500 requests/s (non-stream, whole answer)": ("≤ 2 ms", False),
        "gateway p99 added latency at 500 requests/s (stream, first chunk)": ("≤ 2 ms", True),
        "gateway p50 added latency at 500 requests/s (non-stream, whole answer)": ("≤ 0.5 ms", True),
        "gateway p99 added latency at 1000 requests/s (non-stream, whole answer)": ("≤ 5 ms", True),
        "max sustained requests/s (non-stream)": ("≥ 3,000", True),
        "max sustained requests/s (stream)": ("≥ 2,000", False),
        "max sustained requests/s vs LiteLLM (non-stream)": ("≥ 25x", False),
        "max sustained requests/s vs LiteLLM (stream)": ("≥ 25x", True),
    }
    assert found["max sustained requests/s (stream)"]["note"] == "a lower bound: the load generator was the limit"
    assert found["max sustained requests/s (non-stream)"]["note"] == ""
    # A rate that was not run (above the gateway's max sustained rate) is not measured, and says why.
    skipped = [{"mode": "non-stream", "rate": 1000.0, "arm": "switchyard",
                "note": "not run: above its max sustained rate (800 requests/s)"}]
    [high] = [g for g in goals(skipped, []) if "1000 requests/s" in g["goal"]]
    assert high["met"] is None and high["note"].startswith("not run: above its max sustained rate")


def test_the_overhead_policy_keeps_the_demo_request_path_on() -> None:
    from switchyard.bench.policies import overhead_policy
    from switchyard.policy import compile_policy

    snapshot = compile_policy(overhead_policy(9001, "instant"))
    assert {m.name for m in snapshot.document.models} == {"small", "medium"}
    [route] = snapshot.document.routes
    assert route.name == "auto" and [r.name for r in route.rules] == ["hard-to-medium", "short-and-simple"]
    [tier] = snapshot.document.tiers
    assert tier.limits is not None and tier.limits.tokens_per_minute
    [rule] = snapshot.document.cache
    assert rule.mode == "exact"
