"""`switchyard bench --scenario headline --quick`: a (short) day on fresh fleets, four arms, real processes.

The report is complete and its Markdown and JSON agree; every arm ran the same requests; the region went down
and came back in every arm; the backlog went through the Batch API in the Switchyard arm and as ordinary
requests in the baselines. No wall-clock time and no goal is asserted (a quick run's figures are indicative).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.scenarios.headline.fleet import ARMS, BASELINES, NO_BACKLOG, OUTAGE, SWITCHYARD, TENANTS
from tests.integration.test_bench import assert_landed_alone, assert_same_numbers, quick_report, run_quick


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "headline", 240)


@pytest.fixture(scope="module")
def report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    return quick_report(run, "headline")


@pytest.mark.timeout(300)  # the module's run (four arms of eight engines) is its setup
def test_the_run_writes_a_complete_report_and_stops_everything(
        run: tuple[Path, subprocess.CompletedProcess[str]], report: dict[str, Any]) -> None:
    assert_landed_alone(*run, "headline", ("report.md", "report.json", "headline_day.png", "ttft_cdf.png",
                                           "load_over_time.png"))
    assert_same_numbers(run[0], "headline", report, goals=6)


def test_every_arm_ran_the_same_day_with_its_outage(report: dict[str, Any]) -> None:
    assert tuple(report["arms"]) == ARMS
    requests = report["workload"]["requests"]
    assert requests > 0 and all(report["overall"][arm]["count"] == requests for arm in ARMS)
    source = report["workload"]
    assert (source["peak"], source["trough"]) == (1.5, 0.3) and source["capacity_rps"] > 0
    duration = report["parameters"]["duration_s"]
    for arm in ARMS:
        down, up = report["parameters"]["outage_s"][arm]
        assert down == pytest.approx(OUTAGE[0] * duration, abs=1.0) and up >= OUTAGE[1] * duration - 0.5


def test_the_backlog_goes_through_the_batch_api_only_with_switchyard(report: dict[str, Any]) -> None:
    batch = report["parameters"]["batch"]
    lines = report["parameters"]["batch_lines"]
    assert batch[SWITCHYARD]["via"] == "/v1/batches" and batch[SWITCHYARD]["lines"] == lines > 0
    for arm in BASELINES:
        assert batch[arm]["via"].startswith("ordinary requests") and batch[arm]["done"] > 0
    assert batch[NO_BACKLOG] == {"lines": 0, "done": 0, "failed": 0, "via": ""}
    # The figures hold the day's interactive requests only: every tenant of the day, and no batch line.
    assert sorted(report["groups"]["tenant"]) == sorted(t.name for t in TENANTS)


def test_the_engines_were_sampled_through_the_day_and_the_capacity_is_the_fleets(report: dict[str, Any]) -> None:
    duration = report["parameters"]["duration_s"]
    for arm in ARMS:
        engines = report["engines"][arm]
        assert len(engines["utilisation"]) >= duration - 2  # one sample a second
        known = [v for v in engines["utilisation"] if v is not None]
        assert known and all(0.0 <= v <= 1.0 for v in known) and max(known) > 0
        assert all(v is None or 0.0 <= v <= 1.0 for v in engines["busy"])
        assert all(v is None or v >= 0.0 for v in engines["lag_s"])
        # The throughput in use: within [0, 1] and never more than the time busy (a step counts at most whole).
        in_use = [v for v in engines["in_use"] if v is not None]
        assert in_use and all(0.0 <= v <= 1.0 for v in in_use) and max(in_use) > 0
        assert all(u <= b + 1e-9 for u, b in zip(engines["in_use"], engines["busy"], strict=False)
                   if u is not None and b is not None)
    # What any router could have attained: a share for each class.
    reachable = report["parameters"]["attainable_estimate"]
    assert set(reachable) == {"critical", "standard", "sheddable"}
    assert all(0.0 <= v <= 1.0 for v in reachable.values())
    # The capacity is every engine of the fleet called directly: the two models' pools side by side.
    parts = report["parameters"]["pool_capacity_rps"]
    assert set(parts) == {"small", "large"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(report["parameters"]["capacity_rps"])
    assert report["parameters"]["capacity_clients"] == 32  # 8 engines x --max-num-seqs 4
