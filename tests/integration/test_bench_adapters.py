"""`switchyard bench --scenario adapters --quick`: LoRA adapter-aware picking against least-loaded, real processes.

A run of its own (the shared run of ``test_bench`` leaves it out to fit its time limit): the report is complete,
its Markdown and JSON agree, both arms ran the same schedule on engines serving every adapter, and the figures
agree with each other (the engines' adapter loads per 1,000 requests, the ratios, the popularity bands, the
goals). No wall-clock time and no arm's advantage is asserted.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_bench import assert_landed_alone, assert_same_numbers, quick_report, run_quick

ARMS = ("least-loaded", "adapter-aware")
BANDS = ("hot", "warm", "cold")
FILES = ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png", "shed_fallback.png", "adapter_loads.png")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "adapters", 90)


@pytest.fixture(scope="module")
def report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    return quick_report(run, "adapters")


def _tables(report: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    arms, ratios, bands, machine = report["tables"]
    return arms, ratios, bands, machine


def test_the_run_writes_a_complete_report_and_stops_everything(
        run: tuple[Path, subprocess.CompletedProcess[str]], report: dict[str, Any]) -> None:
    assert_landed_alone(*run, "adapters", FILES)
    assert "adapter_loads.png" in report["plots"]
    for arm in ARMS:  # the engines' state was sampled while each arm ran
        extra = report["timeseries"][arm]["extra"]
        assert set(extra) == {"deferred", "waiting"} and all(extra.values())


def test_markdown_and_json_hold_the_same_numbers(run: tuple[Path, subprocess.CompletedProcess[str]],
                                                 report: dict[str, Any]) -> None:
    md = assert_same_numbers(run[0], "adapters", report, goals=3)
    parameters = report["parameters"]
    assert f"{parameters['adapters']} LoRA adapters" in md and f"`max_loras: {parameters['max_loras']}`" in md
    assert "![adapter_loads](adapter_loads.png)" in md


def test_both_arms_ran_the_same_schedule_over_every_band(report: dict[str, Any]) -> None:
    assert tuple(report["arms"]) == ARMS and report["baseline"] == "least-loaded"
    parameters = report["parameters"]
    assert parameters["picker"] == {"least-loaded": "least-loaded", "adapter-aware": "prefix-aware"}
    assert parameters["adapters_registered"] == "at start-up" and parameters["max_loras"] >= 1
    assert parameters["adapter_load_s"] > 0  # as the engines report it
    requests = report["workload"]["requests"]
    mix = report["workload"]["mix"]
    assert len(mix) == parameters["adapters"] and {m["class"] for m in mix} == set(BANDS)
    assert all(m["stream"] for m in mix)
    for arm in ARMS:
        assert report["overall"][arm]["count"] == requests > 0
        assert set(report["groups"]["class"]) <= set(BANDS)
    assert sum(parameters["band_shares"].values()) == pytest.approx(1.0)


def test_the_figures_agree_with_each_other(report: dict[str, Any]) -> None:
    arms, ratios, bands, machine = _tables(report)
    rows = {r["arm"]: r for r in arms["rows"]}
    assert set(rows) == set(ARMS)
    for arm, row in rows.items():
        overall = report["overall"][arm]
        assert row["requests"] == overall["count"]
        assert row["failed"] == overall["count"] - overall["ok"]
        assert row["ttft_p50_s"] == pytest.approx(overall["ttft_p50_s"])
        assert row["ttft_p99_s"] == pytest.approx(overall["ttft_p99_s"])
        assert row["throughput_rps"] == pytest.approx(overall["throughput_rps"])
        # The engines' counters were read around the arm: the cold adapters had to be loaded somewhere.
        assert row["loads"] > 0 and row["activations"] >= row["loads"] and row["load_seconds"] > 0
        assert row["loads_per_1k"] == pytest.approx(1000 * row["loads"] / row["requests"])
        assert 0 <= row["deferred_mean"] <= row["deferred_max"]
        assert 1 <= row["replicas_per_adapter"] <= report["parameters"]["replicas"]
        assert row["lag_max_s"] is not None and row["lag_max_s"] >= row["lag_p99_s"] >= 0
        assert report["timeseries"][arm]["extra"]["deferred"] and max(
            report["timeseries"][arm]["extra"]["deferred"]) == row["deferred_max"]
    [r] = ratios["rows"]
    aware, base = rows["adapter-aware"], rows["least-loaded"]
    assert r["loads_per_1k"] == pytest.approx(aware["loads_per_1k"] / base["loads_per_1k"])
    assert r["ttft_p90_s"] == pytest.approx(aware["ttft_p90_s"] / base["ttft_p90_s"])
    assert r["throughput_rps"] == pytest.approx(aware["throughput_rps"] / base["throughput_rps"])
    for arm in ARMS:  # the bands split each arm's requests
        mine = [b for b in bands["rows"] if b["arm"] == arm]
        assert [b["band"] for b in mine] == list(BANDS)
        assert sum(b["requests"] for b in mine) == rows[arm]["requests"]
    assert {m["arm"] for m in machine["rows"]} == set(ARMS)


def test_the_goals_are_the_figures(report: dict[str, Any]) -> None:
    arms, ratios, _, _ = _tables(report)
    [r] = ratios["rows"]
    rows = {row["arm"]: row for row in arms["rows"]}
    loads, p90, failed = report["goals"]
    assert loads["value"] == pytest.approx(r["loads_per_1k"]) and loads["met"] == (r["loads_per_1k"] < 1)
    assert p90["value"] == pytest.approx(r["ttft_p90_s"]) and p90["met"] == (r["ttft_p90_s"] <= 1)
    assert failed["value"] == rows["adapter-aware"]["failed"] and failed["met"] == (failed["value"] == 0)
