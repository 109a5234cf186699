"""`switchyard bench` as a user runs it: every landed scenario for a few seconds, real processes.

One quick run of the landed scenarios (plus one that has not landed) writes a complete report:
the run's index and each scenario's Markdown, JSON and PNG plots, with the same numbers in the
Markdown as in the JSON and figures that agree with each other. The LiteLLM arm's install is
skipped with ``--no-litellm`` (it downloads ~100 packages; the full arm runs by hand), and the
report must say so. No wall-clock time is asserted: only completeness and consistency.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.report import TABLE_METRICS, format_value
from switchyard.bench.scenarios import SCENARIOS
from switchyard.bench.tables import render_goal_row, render_row
from tests.integration.conftest import SWITCHYARD

ROOT = Path(__file__).resolve().parents[2]
#: ``overload``, ``failover`` and ``cache`` have quick runs of their own (``test_bench_overload``,
#: ``failover_run``, ``cache_run`` below): with them, this one would not fit the per-test time limit.
#: ``chaos`` is ``failover``'s other name; ``soak`` and ``headline`` have their own (``test_bench_soak``,
#: ``test_bench_headline``), and so have ``canary``, ``adapters`` and ``auto`` (``test_bench_canary``,
#: ``test_bench_adapters``, ``test_bench_auto``).
SEPARATE = ("overload", "failover", "chaos", "cache", "batch", "soak", "headline", "canary", "adapters", "auto")
LANDED = [name for name, s in SCENARIOS.items() if s.landed and name not in SEPARATE]
NOT_LANDED = [name for name, s in SCENARIOS.items() if not s.landed]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ours(marker: str) -> list[str]:
    """Running processes whose command line or environment mentions ``marker`` (the run's folder).

    Engines name their policy file on the command line; gateways get it in their environment.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (marker in cmdline or marker in environ):
            found.append(cmdline)
    return found


def write_conversation_trace(path: Path, requests: int = 1200, seed: int = 3) -> Path:
    """A Mooncake-format trace made here (the public traces live outside the repository):
    conversations that share a system prompt per group and grow by a block or two each turn,
    arriving about 3.3 requests/s like the public conversation trace."""
    rng = random.Random(seed)
    next_id = 1000
    groups = [list(range(g * 4, g * 4 + rng.randint(1, 3))) for g in range(6)]
    live: list[list[int]] = []
    lines, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(3.3) * 1000
        if not live or rng.random() < 0.3:
            live.append(list(rng.choice(groups)))
            if len(live) > 40:
                live.pop(0)
        conversation = rng.choice(live)
        for _ in range(rng.randint(1, 2)):
            conversation.append(next_id)
            next_id += 1
        ids = conversation[:24]
        lines.append(json.dumps({"timestamp": int(t), "input_length": 512 * len(ids) - rng.randint(0, 400),
                                 "output_length": rng.randint(20, 200), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("bench")
    trace = write_conversation_trace(tmp / "conversation.jsonl")
    out = tmp / "report"
    args = [SWITCHYARD, "bench", "--quick", "--no-litellm", "--no-progress", "--out", str(out), "--seed", "3",
            "--trace", str(trace)]
    for name in [*NOT_LANDED[:1], *LANDED]:
        args += ["--scenario", name]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    return out, done


def _json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def run_quick(tmp_path_factory: pytest.TempPathFactory, scenario: str,
              timeout: float) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``switchyard bench --quick`` of one scenario (seed 3) into a fresh folder: the folder and the run."""
    out = tmp_path_factory.mktemp(f"bench-{scenario}") / "report"
    args = [SWITCHYARD, "bench", "--quick", "--no-progress", "--out", str(out), "--seed", "3", "--scenario", scenario]
    return out, subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def quick_report(run: tuple[Path, subprocess.CompletedProcess[str]], name: str) -> dict[str, Any]:
    """The report of scenario ``name`` from a :func:`run_quick` that succeeded."""
    out, done = run
    assert done.returncode == 0, done.stdout + done.stderr
    return _json(out / name / "report.json")


def assert_landed_alone(out: Path, done: subprocess.CompletedProcess[str], name: str,
                        files: tuple[str, ...]) -> dict[str, Any]:
    """A :func:`run_quick` of ``name`` said where its report is, left no process behind, landed, and wrote
    ``files`` and every plot its report lists (PNGs, nothing more): the index (``report.json``)."""
    assert f"report: {out / 'report.md'}" in done.stdout
    assert not _ours(str(out)), "every process the bench started is stopped"
    index = _json(out / "report.json")
    assert [(s["name"], s["status"]) for s in index["scenarios"]] == [(name, "ok")]
    assert not any(line.startswith(f"{name} (") for line in index["not_landed"])
    folder = out / name
    for file in files:
        assert (folder / file).stat().st_size > 0, file
    assert all(png.read_bytes()[:8] == PNG_MAGIC for png in folder.glob("*.png"))
    assert sorted(_json(folder / "report.json")["plots"]) == sorted(p.name for p in folder.glob("*.png"))
    return index


def assert_same_numbers(out: Path, name: str, report: dict[str, Any], goals: int) -> str:
    """A :func:`run_quick` of ``name``: its ``goals`` goals, its tables and its per-arm summary the same in
    its Markdown, the index's and the JSON (``report``): the scenario's Markdown."""
    md = (out / name / "report.md").read_text()
    index_md = (out / "report.md").read_text()
    index = _json(out / "report.json")["scenarios"][0]
    assert index["goals"] == report["goals"] and len(report["goals"]) == goals
    for g in report["goals"]:
        assert render_goal_row(g) in md and render_goal_row(g) in index_md, g["goal"]
    for data in report["tables"]:
        for row in data["rows"]:
            assert render_row(data, row) in md, (data["title"], row)
    for data in index["tables"]:
        assert data in report["tables"]
        for row in data["rows"]:
            assert render_row(data, row) in index_md
    for key, label, mult, dec in TABLE_METRICS:
        cells = [format_value(report["overall"][arm][key], mult, dec) for arm in report["arms"]]
        assert f"| {label} | {' | '.join(cells)} |" in md, label
    return md


@pytest.mark.timeout(300)  # the module's bench run (three scenarios, about 80-140 s on two busy cores) is its setup
def test_the_run_succeeds_and_says_where_the_report_is(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, done = run
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"report: {out / 'report.md'}" in done.stdout
    assert not _ours(str(out)), "every process the bench started is stopped"


def test_every_landed_scenario_wrote_a_complete_report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    index = _json(out / "report.json")
    status = {s["name"]: s["status"] for s in index["scenarios"]}
    assert status == {**dict.fromkeys(LANDED, "ok"), **dict.fromkeys(NOT_LANDED[:1], "not_landed")}
    for name in LANDED:
        folder = out / name
        for file in ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png", "shed_fallback.png"):
            assert (folder / file).stat().st_size > 0, f"{name}/{file}"
        for png in folder.glob("*.png"):
            assert png.read_bytes()[:8] == PNG_MAGIC
        report = _json(folder / "report.json")
        assert sorted(report["plots"]) == sorted(p.name for p in folder.glob("*.png"))
        assert report["goals"] and report["tables"]
        assert all(s["count"] > 0 for s in report["overall"].values()), name
    assert (out / "logs").is_dir() and any((out / "logs").iterdir())


def test_markdown_and_json_hold_the_same_numbers(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    index_md = (out / "report.md").read_text()
    index = {s["name"]: s for s in _json(out / "report.json")["scenarios"]}
    for name in LANDED:
        md = (out / name / "report.md").read_text()
        report = _json(out / name / "report.json")
        for g in report["goals"]:
            assert render_goal_row(g) in md and render_goal_row(g) in index_md, g["goal"]
        for data in report["tables"]:
            for row in data["rows"]:
                assert render_row(data, row) in md, (name, data["title"], row)
        for data in index[name]["tables"]:  # the index copies the scenario's headline tables
            assert data in report["tables"]
            for row in data["rows"]:
                assert render_row(data, row) in index_md
        assert index[name]["goals"] == report["goals"]
        for key, label, mult, dec in TABLE_METRICS:  # the per-arm summary table
            cells = [format_value(report["overall"][arm][key], mult, dec) for arm in report["arms"]]
            assert f"| {label} | {' | '.join(cells)} |" in md, (name, label)


def test_every_scenario_that_has_not_landed_is_named(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    md = (out / "report.md").read_text()
    lines = _json(out / "report.json")["not_landed"]
    assert len(lines) == len(NOT_LANDED)
    for name in NOT_LANDED:
        line = next(x for x in lines if x.startswith(f"{name} ("))
        assert f"not landed yet (issue {SCENARIOS[name].issue}" in line
        assert f"- {line}" in md


def test_overhead_says_litellm_was_not_measured_and_its_figures_agree(
        run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    report = _json(out / "overhead" / "report.json")
    md = (out / "overhead" / "report.md").read_text()
    assert "not measured: --no-litellm" in md
    # The measured request path is the demo policy's kind (kept beside the report), and every exact-cache lookup
    # missed: the engine answered every request the gateway counted.
    policy = (out / "overhead" / "policy.yaml").read_text()
    assert "routes:" in policy and "cache:" in policy and "limits:" in policy
    assert any(n.startswith("Policy (`policy.yaml` beside this report") for n in report["notes"])
    lookups = next(n for n in report["notes"] if n.startswith("The gateway's exact-cache lookups over the run: "))
    assert re.fullmatch(r"The gateway's exact-cache lookups over the run: [\d,]+ miss\.", lookups), lookups
    # Requests/s against `serve --workers N`, N up to the CPUs there are (more than one needs Redis, which the test
    # machines run).
    scaling = next(t for t in report["tables"] if t["title"].startswith("Max sustained requests/s against gateway"))
    rows = {r["workers"]: r for r in scaling["rows"]}
    assert sorted(rows) == list(range(1, min(4, len(os.sched_getaffinity(0))) + 1))
    assert all(r["non-stream_rps"] > 0 and r["stream_rps"] > 0 for r in rows.values()), rows
    # One process on Redis, the base of what more processes add (with Redis's own cost in both).
    on_redis = report["parameters"]["one_process_on_redis"]
    assert on_redis["workers"] == 1 and on_redis["non-stream_rps"] > 0 and on_redis["stream_rps"] > 0
    assert f"carried {on_redis['non-stream_rps']:,.0f} / {on_redis['stream_rps']:,.0f} requests/s" in scaling["note"]
    for n, row in rows.items():
        for mode in ("non-stream", "stream"):
            assert row[f"{mode}_x"] == (None if n == 1 else pytest.approx(row[f"{mode}_rps"] / on_redis[f"{mode}_rps"]))
    lite = [g for g in report["goals"] if "LiteLLM" in g["goal"]]
    assert lite and all(g["met"] is None and "--no-litellm" in g["note"] for g in lite)
    latency, saturation = report["tables"][0]["rows"], report["tables"][1]["rows"]
    for row in latency:
        if row["arm"] == "litellm":
            assert row["note"] == "not measured: --no-litellm"
        elif row.get("requests"):
            assert row["ok_rate"] > 0.99, row  # an engine that answers instantly does not fail
            assert row["p50_s"] <= row["p99_s"]
    for row in saturation:
        if row["arm"] != "litellm":
            assert row["rps"] > 0 and row["error_rate"] == 0, row
    added = next(g for g in report["goals"] if "added latency" in g["goal"] and "non-stream" in g["goal"])
    sy = next(r for r in latency if r["arm"] == "switchyard" and r["mode"] == "non-stream" and r["rate"] == 500)
    if sy.get("requests"):
        assert added["value"] == sy["added_p99_s"]
    else:  # a machine that cannot sustain the goal rate skips the step, and the goal says so
        assert added["value"] is None and added["met"] is None
        assert sy["note"].startswith("not run: above its max sustained rate") and added["note"] == sy["note"]
    # What stands in the way: the gateway's own loop lag and GC pauses around its goal-rate steps, and where an
    # uncounted second gateway with the stall sampler on found its loop thread.
    tables = {t["title"]: t for t in report["tables"]}
    lags = [t for name, t in tables.items() if name.startswith("Gateway event-loop lag")]
    # (A step runs only where the gateway sustains its rate: on a slow or busy machine a step may not.)
    ran = {r["mode"] for r in latency if r["arm"] == "switchyard" and r["rate"] == 500 and r.get("requests")}
    rows = [r for t in lags for r in t["rows"]]
    assert len(lags) <= 1 and (lags or not ran) and {r["mode"] for r in rows} == ran
    assert all(r["checks"] > 0 and r["gc0"] >= 0 for r in rows)
    stalls = tables["Where the gateway's event loop stalled (diagnostic step, not counted)"]
    logged = [line for line in (out / "logs" / "gateway-stalls.log").read_text().splitlines()
              if "event loop stalled" in line]
    assert f"; {len(logged)} stalls of 3 ms or more were logged" in stalls["note"]
    assert sum(r["stalls"] for r in stalls["rows"]) <= len(logged)


def test_prefix_figures_agree_with_the_engines_and_the_bound(
        run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    report = _json(out / "prefix" / "report.json")
    bounds = report["parameters"]["bounds"]["mooncake"]  # --quick: the first workload only
    bound, oracle = bounds["unbounded_bound"], bounds["oracle"]
    assert 0 < oracle <= 1 and 0 < bound < 1
    rows = {r["arm"]: r for r in report["tables"][0]["rows"]}
    arms = ("precise", "approximate", "least-loaded", "round-robin")
    assert set(rows) == {*arms, "oracle (offline)"}
    assert set(report["arms"]) == {f"mooncake/{a}" for a in arms}
    for arm in arms:
        row, name = rows[arm], f"mooncake/{arm}"
        assert 0 <= row["hit_ratio"] <= 1
        assert row["of_bound"] == pytest.approx(row["hit_ratio"] / bound)
        assert row["of_oracle"] == pytest.approx(row["hit_ratio"] / oracle)
        assert row["throughput_rps"] == pytest.approx(report["overall"][name]["throughput_rps"])
        assert report["overall"][name]["count"] == report["workload"]["requests"]
        assert report["timeseries"][name]["extra"]["engine queue (waiting)"]
    # The precise arm followed every engine's events, and the gateway counted what they cost it.
    [events] = next(t for t in report["tables"] if t["title"].startswith("KV-cache events"))["rows"]
    assert events["live"] == "8 of 8" and events["events_per_s"] > 0 and events["events_cpu"] is not None
    assert {g["goal"] for g in report["goals"]} >= {"mooncake: precise hits as a share of the oracle's",
                                                    "mooncake: gateway CPU spent on KV events"}


def _complete_report(out: Path, done: subprocess.CompletedProcess[str], name: str,
                     files: tuple[str, ...]) -> dict[str, Any]:
    """A quick run of one scenario that succeeded and left no process behind, and its report: every file
    written, its goals and tables the same in the scenario's Markdown, the index and the JSON."""
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _ours(str(out)), "every process the bench started is stopped"
    index = _json(out / "report.json")
    assert [(s["name"], s["status"]) for s in index["scenarios"]] == [(name, "ok")]
    folder = out / name
    for file in files:
        assert (folder / file).stat().st_size > 0, file
    report = _json(folder / "report.json")
    md, index_md = (folder / "report.md").read_text(), (out / "report.md").read_text()
    assert index["scenarios"][0]["goals"] == report["goals"]
    for g in report["goals"]:
        assert render_goal_row(g) in md and render_goal_row(g) in index_md, g["goal"]
    for data in report["tables"]:
        for row in data["rows"]:
            assert render_row(data, row) in md, (data["title"], row)
    for data in index["scenarios"][0]["tables"]:
        assert data in report["tables"]
    return report


@pytest.fixture(scope="module")
def failover_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "failover", 110)


def test_failover_writes_a_complete_report_with_the_same_numbers(
        failover_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    report = _complete_report(*failover_run, "failover",
                              ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png", "shed_fallback.png"))
    extra = report["timeseries"]["switchyard"]["extra"]
    assert set(extra) == {"us-east engines running", "eu-west engines running"} and all(extra.values())


def test_failover_figures_agree(failover_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = failover_run
    report = _json(out / "failover" / "report.json")
    line = report["parameters"]["timeline"]
    assert [o["kind"] for o in line] == report["parameters"]["outages"] == ["down", "kill", "hang"]
    for o, following in itertools.pairwise(line):  # staged one after the other, the region back between
        assert o["ready_s"] <= following["start_s"] and o["back_s"] is not None and o["back_s"] <= following["start_s"]
    for o in line:  # each outage was staged and undone (the control server; the kill: a new process)
        assert o["start_s"] <= o["applied_s"] < o["end_s"] <= o["restored_s"] <= o["ready_s"]
    outages, detect, waits, load, phases, _, slowest, failed, _ = report["tables"]
    total = report["overall"]["switchyard"]["count"]
    assert sum(p["requests"] for p in phases["rows"]) == total == load["rows"][-1]["requests"]
    assert [p["phase"] for p in load["rows"]] == ["before", "down", "between-1", "kill", "between-2", "hang", "after",
                                                  "whole run"]
    assert sum(p["requests"] for p in load["rows"][:-1]) == total
    not_complete = sum(o["requests"] - o["complete"] for o in outages["rows"])
    assert len(failed["rows"]) >= min(30, not_complete)  # every outage's failure is listed (and the others')
    goals = {g["goal"]: g for g in report["goals"]}
    assert len(goals) == 6 and all(g["value"] is not None and g["met"] is not None for g in goals.values()), goals
    for o in outages["rows"]:
        assert o["requests"] > o["in_flight"] > 0  # requests were sent during each outage, and ran at its fault
        assert o["resumes"] is not None and o["hedges"] is not None  # the gateway's /metrics were read at its edges
        assert goals[f"requests answered completely in the {o['outage']} phase"]["value"] == o["complete_rate"]
    kill = next(o for o in outages["rows"] if o["outage"] == "kill")
    assert kill["complete"] == kill["requests"]  # the streams running on the killed engines were resumed
    hang = next(o for o in detect["rows"] if o["outage"] == "hang")
    assert goals["hang detected and traffic moved off us-east"]["value"] == max(hang["out_all_s"], hang["moved_s"])
    assert goals["longest client wait (streams: first token; complete answers: whole time)"]["value"] == \
        waits["rows"][-1]["wait_max_s"] == slowest["rows"][0]["wait_s"]
    run = load["rows"][-1]
    assert run["home_received"] and run["healthy_received"]  # both regions' engines were read (across the kill)
    assert goals["engine requests per client request over the run"]["value"] == run["engine_ratio"] == \
        pytest.approx((run["home_received"] + run["healthy_received"]) / total)


@pytest.fixture(scope="module")
def cache_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "cache", 90)


def test_cache_writes_a_complete_report_with_the_same_numbers(
        cache_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    report = _complete_report(*cache_run, "cache", ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png"))
    assert not any(line.startswith("cache (") for line in _json(cache_run[0] / "report.json")["not_landed"])
    assert report["arms"] == ["cache", "no-cache"] and report["baseline"] == "no-cache"
    assert all(report["timeseries"][arm]["extra"]["engines running"] for arm in report["arms"])


def test_cache_figures_agree(cache_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = cache_run
    report = _json(out / "cache" / "report.json")
    hits, speedup, latency, misses, engines = report["tables"]
    rows = {r["family"]: r for r in hits["rows"]}
    total = report["workload"]["requests"]
    bound = report["parameters"]["repeat_bound"]
    for arm in report["arms"]:  # both arms ran the whole workload, and every request was answered
        assert report["overall"][arm]["count"] == total and report["overall"][arm]["ok_rate"] == 1.0
    assert sum(rows[f]["requests"] for f in ("chat", "faq", "sampled")) == rows["all"]["requests"] == total
    for family, rule in (("chat", "exact"), ("faq", "faq")):
        row = rows[family]
        assert row["rule"] == rule and row["errors"] == 0
        assert row["full_hits"] == row["hits"]  # a hit carries the usage of the answer it copies
        assert sum(m["n"] for m in misses["rows"] if m["rule"] == rule) == row["misses"]
        assert row["hits"] + row["misses"] == row["requests"] == bound[family]["requests"]
        assert row["hit_ratio"] == pytest.approx(row["hits"] / row["requests"])
        repeats = bound[family]["repeats" if family == "chat" else "group_repeats"]
        assert row["bound"] == pytest.approx(repeats / row["requests"])
        assert row["hits"] <= repeats and row["reachable"] <= row["bound"]  # no hit without an earlier request
        if row["bound"]:
            assert row["of_bound"] == pytest.approx(row["hit_ratio"] / row["bound"])
        # the response headers and the gateway's counters tell the same story
        assert row["metrics_hits"] == row["hits"] and row["metrics_lookups"] == row["requests"]
    assert rows["chat"]["hits"] > 0 and rows["faq"]["hits"] > 0  # the quick run has repeats of both kinds
    assert rows["sampled"]["hits"] == 0 and rows["sampled"]["with_header"] == 0
    assert rows["all"]["hits"] == rows["chat"]["hits"] + rows["faq"]["hits"] == rows["all"]["metrics_hits"]
    cache, no_cache = engines["rows"]
    assert (cache["arm"], no_cache["arm"]) == ("cache", "no-cache")
    assert no_cache["engine_requests"] == total and no_cache["metrics_lookups"] == 0 and no_cache["hits"] == 0
    assert cache["hits"] == rows["all"]["hits"] == cache["saved"] == total - cache["engine_requests"]
    assert cache["stored"] == rows["chat"]["misses"] + rows["faq"]["misses"]  # every miss's answer is stored
    assert cache["entries"] == cache["distinct"] <= cache["stored"] and cache["bytes"] > 0
    by = {(r["requests"], r["stream"]): r for r in latency["rows"]}
    assert by[("hits (all)", "all")]["n"] == rows["all"]["hits"] == by[("the same requests as the hits", "all")]["n"]
    assert by[("hits (exact)", "all")]["n"] == rows["chat"]["hits"]
    assert by[("hits (semantic)", "all")]["n"] == rows["faq"]["hits"]
    assert by[("misses", "all")]["n"] == rows["chat"]["misses"] + rows["faq"]["misses"]
    for row in latency["rows"]:
        if row["n"]:
            assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["e2e_p50_s"] <= row["e2e_p99_s"]
    speed = next(r for r in speedup["rows"] if r["stream"] == "all" and r["against"] == "misses")
    hit_p50, miss_p50 = by[("hits (all)", "all")]["e2e_p50_s"], by[("misses", "all")]["e2e_p50_s"]
    assert hit_p50 < miss_p50 and speed["e2e_p50_s"] == pytest.approx(miss_p50 / hit_p50)
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["hits vs misses, end-to-end p50"]["value"] == speed["e2e_p50_s"]
    assert goals["exact hit ratio of its repeat bound"]["value"] == rows["chat"]["of_bound"]
    assert goals["semantic hit ratio of its repeat bound"]["value"] == rows["faq"]["of_bound"]
    assert goals["engine requests saved = hits"]["value"] == cache["saved"]


def test_reload_figures_agree(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = run
    report = _json(out / "reload" / "report.json")
    publishes = report["parameters"]["publishes"]
    to_b, at_a, calls = report["tables"][0]["rows"]
    assert to_b["n"] == at_a["n"] == calls["n"] == publishes > 0
    for row in (to_b, at_a, calls):
        assert 0 <= row["p50_s"] <= row["p90_s"] <= row["p99_s"] <= row["max_s"]
    propagation, failed, misversioned = report["goals"]
    assert propagation["value"] == to_b["max_s"]
    total = sum(report["overall"][arm]["count"] for arm in report["arms"])
    assert failed["note"].startswith(f"of {total}") and failed["value"] == 0 and misversioned["value"] == 0


def test_ctrl_c_stops_everything_the_bench_started(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    args = [SWITCHYARD, "bench", "--scenario", "failover", "--quick", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # wait until the engines and the gateway run and the load is on
            if "requests over" in line or time.monotonic() > deadline:
                break
        assert _ours(str(out)), "the engines run"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _ours(str(out))
    assert "**Interrupted**" in (out / "report.md").read_text()
