"""``switchyard bench canary --quick``: under steady load on two gateway replicas, a harmless candidate is promoted
through its steps and a costly one is rolled back by the guards; the report counts what the costly one decided
(from the answers' route headers) and how long it ran, and its goals agree with those figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import SWITCHYARD
from tests.integration.test_bench import _complete_report


@pytest.fixture(scope="module")
def canary_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench-canary") / "report"
    args = [SWITCHYARD, "bench", "canary", "--quick", "--no-progress", "--out", str(out), "--seed", "3"]
    return out, subprocess.run(args, capture_output=True, text=True, timeout=170)


def _goal(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in report["goals"] if g["goal"] == name)


def _canary(report: dict[str, Any], label: str) -> dict[str, Any]:
    return next(c for c in report["figures"]["canaries"] if c["candidate"] == label)


@pytest.mark.timeout(180)  # the module's run (about 80 s on two cores) is its setup
def test_canary_writes_a_complete_report(canary_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    report = _complete_report(*canary_run, "canary", ("report.md", "report.json", "ttft_cdf.png"))
    assert report["overall"] and all(s["count"] > 0 for s in report["overall"].values())
    assert report["figures"]["requests"] > 1000


def test_the_good_candidate_is_promoted_through_its_steps(
        canary_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = canary_run
    report = json.loads((out / "canary" / "report.json").read_text())
    good = _canary(report, "good")
    assert (good["status"], good["aborted"], good["reason"]) == ("promoted", False, "all 3 steps passed")
    assert good["percents_reached"] == [5.0, 25.0, 50.0]
    assert [s["step"] for s in good["steps"]] == [1, 2, 3]
    assert all(s["decided"] > 0 for s in good["steps"])
    # Each step's slice took more of the traffic than the one before; none took it all.
    shares = [s["share"] for s in good["steps"]]
    assert shares == sorted(shares) and shares[0] > 0 and shares[-1] < 0.9
    assert good["decided_while_running"] == sum(s["decided"] for s in good["steps"])
    # Every step passed on guards tested over a window holding its slice's requests, none of them breached.
    for step in good["steps"]:
        assert step["tests"] > 0 and step["n_tested"] >= 20 and step["least_p"] >= step["alpha_each"], step
    assert _goal(report, "good candidate promoted through its steps")["met"] is True


def test_the_bad_candidate_is_rolled_back_and_what_it_decided_is_counted(
        canary_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = canary_run
    report = json.loads((out / "canary" / "report.json").read_text())
    good, bad = _canary(report, "good"), _canary(report, "bad")
    assert bad["version"] == good["version"] + 1 and bad["base"] == good["version"]  # rolled out on top of it
    assert (bad["status"], bad["aborted"]) == ("rolled_back", False)
    assert bad["breaches"] and any(g in bad["reason"] for g in ("ttft_p99", "cost_per_1k"))
    last = bad["steps"][-1]  # the step it was rolled back in: a test below its share of alpha
    assert last["tests"] > 0 and last["least_p"] < last["alpha_each"]
    assert bad["duration_s"] is not None and 0 < bad["duration_s"] < 90
    assert bad["percents_reached"][0] == 1.0 and len(bad["percents_reached"]) < 3  # never reached 50%
    # What it decided: counted from the route headers, a small share of what was sent while it ran.
    assert 0 < bad["decided_while_running"] <= bad["decided_total"]
    assert bad["decided_total"] == bad["decided_while_running"] + bad["decided_after_end"]
    assert 0 < bad["share_while_running"] < 0.1
    assert bad["share_while_running"] == pytest.approx(bad["decided_while_running"] / bad["requests_while_running"])
    slice_, rest = bad["client"]
    assert slice_["on_large"] == 1.0 and rest["on_large"] < 0.5  # every request it decided went to large
    assert slice_["cost_per_1k"] > rest["cost_per_1k"]
    detect = _goal(report, "bad candidate: start → rollback")
    assert detect["value"] == pytest.approx(bad["duration_s"]) and detect["met"] == (bad["duration_s"] <= 120)
    share = _goal(report, "requests decided by the bad candidate")
    assert share["value"] == pytest.approx(bad["share_while_running"])
    assert _goal(report, "bad candidate rolled back automatically")["met"] is True
