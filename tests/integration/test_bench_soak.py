"""``switchyard bench soak``: a quick run (named as an argument, as the issue writes it) drives every kind of
request of the mix through a real gateway, rewrites the policy under load, reads the gateway's resources
from ``/proc``, and writes a complete report whose goals agree with its own figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.scenarios.soak.workload import MIX
from tests.integration.conftest import SWITCHYARD
from tests.integration.test_bench import _complete_report


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench-soak") / "report"
    args = [SWITCHYARD, "bench", "soak", "--quick", "--no-progress", "--out", str(out), "--seed", "3"]
    return out, subprocess.run(args, capture_output=True, text=True, timeout=150)


def _goal(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in report["goals"] if g["goal"] == name)


def test_soak_writes_a_complete_report(soak_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    report = _complete_report(*soak_run, "soak", ("report.md", "report.json", "memory_over_time.png"))
    assert "memory_over_time.png" in report["plots"]
    samples = report["samples"]
    assert len(samples) >= 15  # every 0.5 s over 12 s
    assert all(s["rss_mib"] > 20 and s["fds"] > 3 and s["threads"] >= 1 for s in samples)
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert samples[-1]["requests"] > 200 and samples[-1]["unexpected"] == 0


def test_every_kind_got_what_it_must_and_nothing_else(soak_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = soak_run
    report = json.loads((out / "soak" / "report.json").read_text())
    kinds = {row["kind"]: row for row in report["tables"][1]["rows"]}
    assert set(kinds) == {k.name for k in MIX}
    for kind in MIX:
        row = kinds[kind.name]
        assert row["sent"] > 0 and row["unexpected"] == 0, row
        statuses = {int(part.split(":")[0]) for part in row["got"].split(", ")}
        assert statuses <= kind.expected, row
    assert {int(p.split(":")[0]) for p in kinds["over limit"]["got"].split(", ")} == {200, 429}
    assert _goal(report, "unexpected errors")["met"] is True


def test_rewrites_are_served_and_the_cache_answers_repeats(
        soak_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = soak_run
    report = json.loads((out / "soak" / "report.json").read_text())
    rewrites = _goal(report, "policy rewrites served")
    assert rewrites["met"] is True and rewrites["value"] >= 3  # every 3 s over 12 s
    hits = next(n for n in report["notes"] if n.startswith("Response-cache hits"))
    assert int(hits.split(": ")[1].split(",")[0]) > 0, hits
    trend = report["trend"]
    assert trend["samples"] >= 10 and trend["median_mib"] > 20
    assert _goal(report, "gateway RSS: no growing trend")["value"] == pytest.approx(trend["rise_mib"])
