"""`switchyard bench --scenario batch --quick`: interactive load with and without a batch, real processes.

A run of its own (like ``overload``'s): the report is complete, its Markdown and JSON agree, both
arms ran the same interactive schedule at half the measured capacity and answered every request
(nothing hangs or breaks), the batch went through the Files and Batch API and completed lines
inside the window, every line is accounted for after the cancel, and the idle-capacity figures
follow from each other. The goals themselves (share of idle capacity, TTFT p99 ratio) are
wall-clock figures of a noisy machine: they must be measured, not met.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_bench import assert_landed_alone, assert_same_numbers, quick_report, run_quick

ARMS = ["without-batch", "with-batch"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "batch", 150)


@pytest.fixture(scope="module")
def report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    return quick_report(run, "batch")


def _tables(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["title"]: t for t in report["tables"]}


def _table(report: dict[str, Any], starts: str) -> dict[str, Any]:
    return next(t for title, t in _tables(report).items() if title.startswith(starts))


def test_the_run_writes_a_complete_report_and_stops_everything(
        run: tuple[Path, subprocess.CompletedProcess[str]], report: dict[str, Any]) -> None:
    out, done = run
    index = assert_landed_alone(out, done, "batch", ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png",
                                                     "shed_fallback.png", "batch_progress.png"))
    assert sorted(index["scenarios"][0]["plots"]) == sorted(f"batch/{p}" for p in report["plots"])
    md = (out / "batch" / "report.md").read_text()
    assert "![batch_progress](batch_progress.png)" in md


def test_markdown_and_json_hold_the_same_numbers(run: tuple[Path, subprocess.CompletedProcess[str]],
                                                 report: dict[str, Any]) -> None:
    assert_same_numbers(run[0], "batch", report, goals=3)


def test_both_arms_ran_the_same_schedule_at_half_the_measured_capacity_and_answered_it(
        report: dict[str, Any]) -> None:
    assert report["arms"] == ARMS and report["baseline"] == "without-batch"
    requests = report["workload"]["requests"]
    capacity = _table(report, "Capacity")["rows"]
    assert [r["arm"] for r in capacity] == ARMS
    assert all(r["rps"] > 0 and r["output_tps"] > 0 and r["failed"] == 0 for r in capacity)
    assert report["parameters"]["capacity_output_tps"] == capacity[0]["output_tps"]
    assert report["workload"]["rate_per_s"] == pytest.approx(report["parameters"]["load"] * capacity[0]["rps"])
    rows = {r["arm"]: r for r in _table(report, "Interactive traffic without")["rows"]}
    for arm in ARMS:
        overall = report["overall"][arm]
        assert overall["count"] == requests > 0
        assert rows[arm]["requests"] == requests and rows[arm]["answered"] == overall["ok"] > 0
        # Every request got its answer: nothing hung or broke. (A host so busy that the processes
        # stall for seconds can get clear 503 refusals; the failures column names them.)
        assert overall["errors"] == overall["timeouts"] == 0, rows[arm]["failures"]
        assert overall["ok"] + overall["shed"] == requests
        assert rows[arm]["failed"] == requests - overall["ok"]
        assert (rows[arm]["failures"] == "-") == (rows[arm]["failed"] == 0)
        assert rows[arm]["ttft_p50_s"] == pytest.approx(overall["ttft_p50_s"])
        assert rows[arm]["ttft_p99_s"] == pytest.approx(overall["ttft_p99_s"])
        assert rows[arm]["interactive_tps"] > 0
        assert rows[arm]["queued"] >= 0  # the gateway's metrics were read
        assert (rows[arm]["queue_wait_mean_s"] is None) == (rows[arm]["queued"] == 0)
    ratios = _table(report, "Interactive traffic: with")["rows"][0]
    assert ratios["ttft_p99_s"] == pytest.approx(rows["with-batch"]["ttft_p99_s"] / rows["without-batch"]["ttft_p99_s"])


def test_the_batch_ran_in_the_window_and_every_line_is_accounted_for(report: dict[str, Any]) -> None:
    rows = {r["arm"]: r for r in _table(report, "Interactive traffic without")["rows"]}
    assert rows["without-batch"]["batch_tps"] == rows["without-batch"]["batch_lines_completed"] == 0
    assert not any(report["batch_progress"]["without-batch"]["batch_completion_tokens"])
    assert rows["with-batch"]["batch_lines_completed"] > 0 and rows["with-batch"]["batch_tps"] > 0
    assert rows["with-batch"]["batch_lines_failed"] == 0
    job = _table(report, "The batch job")["rows"][0]
    assert job["lines"] == report["parameters"]["batch_lines"] > 0
    assert job["first_line_s"] is not None and job["first_line_s"] >= 0
    # It outlasted the window, was cancelled, and every line either ran or was cancelled unrun.
    assert job["status"] == "cancelled"
    assert job["completed"] >= rows["with-batch"]["batch_lines_completed"] and job["failed"] == 0
    assert job["output_ok"] == job["completed"] and job["output_tokens"] > 0
    assert job["completed"] + job["error_lines"] == job["lines"]
    assert job["error_codes"] == f"batch_cancelled {job['error_lines']}"
    progress = report["batch_progress"]["with-batch"]
    for key in ("batch_completion_tokens", "interactive_completion_tokens", "batch_completed", "t_s"):
        assert progress[key] == sorted(progress[key]), key  # cumulative counts, read in time order
    assert progress["t_s"][0] <= 0 < report["parameters"]["duration_s"] <= progress["t_s"][-1]


def test_the_idle_capacity_figures_follow_from_each_other(report: dict[str, Any]) -> None:
    share = _table(report, "The batch lane's share")["rows"][0]
    with_batch = next(r for r in _table(report, "Interactive traffic without")["rows"] if r["arm"] == "with-batch")
    assert share["capacity_tps"] == report["parameters"]["capacity_output_tps"]
    assert share["interactive_tps"] == with_batch["interactive_tps"]
    assert share["batch_tps"] == with_batch["batch_tps"]
    assert share["idle_tps"] == pytest.approx(share["capacity_tps"] - share["interactive_tps"])
    assert share["idle_tps"] > 0
    assert share["share"] == pytest.approx(share["batch_tps"] / share["idle_tps"])
    assert share["pool_tps"] == pytest.approx(share["interactive_tps"] + share["batch_tps"])
    goals = {g["goal"].split(" (")[0]: g for g in report["goals"]}
    assert goals["the batch lane's share of the idle capacity"]["value"] == share["share"]
    ratios = _table(report, "Interactive traffic: with")["rows"][0]
    assert goals["interactive TTFT p99 with the batch ÷ without"]["value"] == ratios["ttft_p99_s"]
    assert all(isinstance(g["met"], bool) for g in report["goals"]), "every goal was measured"
    unanswered = goals["interactive requests not answered while the batch ran"]
    assert unanswered["value"] == with_batch["failed"] and unanswered["met"] is (with_batch["failed"] == 0)
