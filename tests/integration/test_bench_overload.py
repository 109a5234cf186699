"""`switchyard bench --scenario overload --quick`: flow control on and off, side by side, with real processes.

A run of its own (the shared run of ``test_bench`` leaves it out to fit the time limit): the report
is complete, its Markdown and JSON agree, both arms ran the same schedule, and the figures say what
flow control does (the best class kept whole, the worst one shed; nothing shed, downgraded or queued
with it off). No wall-clock time is asserted.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_bench import assert_landed_alone, assert_same_numbers, quick_report, run_quick

CLASSES = ("critical", "standard", "sheddable")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "overload", 110)


@pytest.fixture(scope="module")
def report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    return quick_report(run, "overload")


def test_the_run_writes_a_complete_report_and_stops_everything(
        run: tuple[Path, subprocess.CompletedProcess[str]], report: dict[str, Any]) -> None:
    assert_landed_alone(*run, "overload",
                        ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png", "shed_fallback.png"))
    for arm in report["arms"]:
        extra = report["timeseries"][arm]["extra"]
        assert set(extra) == {"gateway queue", "engine queue (waiting)", "engine running"} and all(extra.values())


def test_markdown_and_json_hold_the_same_numbers(run: tuple[Path, subprocess.CompletedProcess[str]],
                                                 report: dict[str, Any]) -> None:
    md = assert_same_numbers(run[0], "overload", report, goals=3)
    for cls in CLASSES:  # the SLOs are printed
        assert f"{cls} {report['parameters']['slo_ttft_s'][cls] * 1000:g} ms" in md


def test_both_arms_ran_the_same_schedule_at_twice_the_measured_capacity(report: dict[str, Any]) -> None:
    on, off = report["arms"]
    assert (on, off) == ("flow-control-on", "flow-control-off") and report["baseline"] == off
    requests = report["workload"]["requests"]
    assert report["overall"][on]["count"] == report["overall"][off]["count"] == requests > 0
    capacity = report["tables"][3]["rows"]
    assert [r["arm"] for r in capacity] == [on, off]
    assert all(r["rps"] > 0 and r["failed"] == 0 for r in capacity)
    assert report["parameters"]["capacity_rps"] == capacity[0]["rps"]
    assert report["workload"]["rate_per_s"] == pytest.approx(2 * capacity[0]["rps"])


def test_the_class_figures_agree_with_the_summaries(report: dict[str, Any]) -> None:
    rows = {(r["class"], r["arm"]): r for r in report["tables"][0]["rows"]}
    for cls in CLASSES:
        for arm in report["arms"]:
            row, summary = rows[(cls, arm)], report["groups"]["class"][cls]["arms"][arm]
            assert row["requests"] == summary["count"] > 0
            assert row["slo_ttft_s"] == report["slo"][cls]["ttft_s"] > 0
            assert row["attainment"] == pytest.approx(summary["slo_attainment"])
            assert row["goodput_rps"] == pytest.approx(summary["goodput_rps"])
            assert row["shed_rate"] == pytest.approx(summary["shed_rate"])
            tenants = [report["groups"]["tenant"][f"{cls}-{kind}"]["arms"][arm] for kind in ("noisy", "quiet")]
            assert [t["slo_attainment"] for t in tenants] == pytest.approx(
                [row["noisy_attainment"], row["quiet_attainment"]])
    for arm in report["arms"]:
        assert rows[("all", arm)]["attainment"] == pytest.approx(report["overall"][arm]["slo_attainment"])
    ratios = {r["class"]: r for r in report["tables"][1]["rows"]}
    on, off = report["arms"]
    for cls in (*CLASSES, "all"):
        base = rows[(cls, off)]["goodput_rps"]
        expected = rows[(cls, on)]["goodput_rps"] / base if base else None
        assert ratios[cls]["goodput_rps"] == (pytest.approx(expected) if expected is not None else None)


def test_flow_control_keeps_the_best_class_and_sheds_the_worst(report: dict[str, Any]) -> None:
    on, off = report["arms"]
    rows = {(r["class"], r["arm"]): r for r in report["tables"][0]["rows"]}
    assert rows[("critical", on)]["attainment"] >= rows[("critical", off)]["attainment"]
    assert rows[("sheddable", on)]["shed_rate"] > 0
    assert rows[("critical", on)]["downgrade_rate"] == rows[("sheddable", on)]["downgrade_rate"] == 0
    assert report["overall"][on]["timeouts"] == report["overall"][on]["errors"] == 0  # nothing hangs
    critical = next(g for g in report["goals"] if g["goal"].startswith("critical"))
    assert critical["value"] == rows[("critical", on)]["attainment"]


def test_with_flow_control_off_nothing_is_shed_downgraded_or_queued(report: dict[str, Any]) -> None:
    on, off = report["arms"]
    rows = {(r["class"], r["arm"]): r for r in report["tables"][0]["rows"]}
    for cls in CLASSES:
        assert rows[(cls, off)]["shed_rate"] == rows[(cls, off)]["downgrade_rate"] == 0
    assert not any(report["timeseries"][off]["extra"]["gateway queue"])
    for row in report["tables"][2]["rows"]:  # and the gateway counted what its clients saw
        if row["arm"] == on:
            assert (row["gateway_shed"], row["gateway_downgrades"]) == (row["shed"], row["downgraded"]), row
        else:
            assert row["shed"] == row["gateway_shed"] == row["gateway_downgrades"] == row["queued"] == 0, row
