"""`switchyard bench --scenario auto --quick`: the shipped ``auto`` rules on the labelled set, through a real gateway.

The gateway's answers must say what its own decisions say: every prompt lands where a dry run of the
shipped policy sends it (the same decisions, in another process), the figures add up, the report's
Markdown and JSON agree, and everything the bench started is stopped. No wall-clock time is asserted.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.labelled import load_prompts
from switchyard.bench.scenarios.auto.scenario import QUICK_EVERY
from switchyard.decide.dryrun import dry_run
from switchyard.policy import compile_policy
from switchyard.resources import demo_policy
from switchyard.whatif.difficulty_fit import features_of
from tests.integration.test_bench import PNG_MAGIC, _json, _ours, assert_same_numbers, run_quick


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return run_quick(tmp_path_factory, "auto", 100)


@pytest.fixture(scope="module")
def report(run: tuple[Path, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    out, done = run
    assert done.returncode == 0, done.stdout + done.stderr
    return _json(out / "auto" / "report.json")


def test_the_run_writes_a_complete_report_and_stops_everything(
        run: tuple[Path, subprocess.CompletedProcess[str]], report: dict[str, Any]) -> None:
    out, done = run
    assert f"report: {out / 'report.md'}" in done.stdout
    assert not _ours(str(out)), "every process the bench started is stopped"
    assert [(s["name"], s["status"]) for s in _json(out / "report.json")["scenarios"]] == [("auto", "ok")]
    folder = out / "auto"
    for file in ("report.md", "report.json", "ttft_cdf.png", "load_over_time.png", "shed_fallback.png"):
        assert (folder / file).stat().st_size > 0, file
    assert all(png.read_bytes()[:8] == PNG_MAGIC for png in folder.glob("*.png"))
    assert report["plots"] and sorted(report["plots"]) == sorted(p.name for p in folder.glob("*.png"))
    assert report["overall"]["switchyard"]["count"] == report["figures"]["prompts"]


def test_every_prompt_lands_where_the_gateways_own_decisions_send_it(report: dict[str, Any]) -> None:
    f = report["figures"]
    prompts = load_prompts()[::QUICK_EVERY]
    assert f["prompts"] == report["parameters"]["sent"] == len(prompts)
    assert (f["refused"], f["served_elsewhere"]) == (0, 0)
    path = demo_policy()
    snapshot = compile_policy(path.read_text(), str(path))
    decided = {p.id: dry_run(snapshot, "pro", features_of(p)) for p in prompts}
    expected = Counter((p.split, p.label, decided[p.id].model) for p in prompts)
    for row in f["by_label"]:
        for model in f["models"]:
            want = sum(n for (split, label, m), n in expected.items()
                       if m == model and row["split"] in ("all", split) and row["label"] in ("all", label))
            assert row[model] == want, (row, model)
    cheapest, compare = f["cheapest"], f["compare"]
    misrouted = [p.id for p in prompts if (p.hard and decided[p.id].model == cheapest)
                 or (not p.hard and decided[p.id].model == compare)]
    assert [m["id"] for m in f["misrouted"]] == misrouted


def test_the_figures_add_up(report: dict[str, Any]) -> None:
    f = report["figures"]
    assert (f["compare"], f["cheapest"], f["models"]) == ("large", "small", ["small", "medium", "large"])
    rows = {(r["split"], r["label"]): r for r in f["by_label"]}
    for key, row in rows.items():
        assert sum(row[m] for m in f["models"]) + row["refused"] == row["n"], key
    assert rows["all", "easy"]["n"] + rows["all", "hard"]["n"] == rows["all", "all"]["n"] == f["prompts"]
    assert sum(r["easy"] + r["hard"] for r in f["by_rule"]) == f["prompts"]
    # Cheap requests go to cheap models, hard ones to the large model.
    assert rows["all", "easy"]["small"] > 0.7 * rows["all", "easy"]["n"]
    assert rows["all", "hard"]["large"] > 0.8 * rows["all", "hard"]["n"]
    easy, hard, whole, mix = f["costs"]
    assert (easy["n"], hard["n"], whole["n"]) == (rows["all", "easy"]["n"], rows["all", "hard"]["n"], f["prompts"])
    assert whole["auto"] < whole["all"] and easy["auto"] < 0.25 * easy["all"]
    assert whole["ratio"] == pytest.approx(whole["auto"] / whole["all"]) == f["cost_ratio"]
    assert easy["auto"] < whole["auto"] < hard["auto"]
    assert mix["all"] == pytest.approx(0.8 * easy["all"] + 0.2 * hard["all"])
    assert f["hard_to_cheapest"] == pytest.approx(rows["all", "hard"]["small"] / rows["all", "hard"]["n"])
    # The engine counts the chat template too: more tokens than the text sent.
    assert f["prompt_tokens"] > report["overall"]["switchyard"]["count"] * 10
    quality = {(r["classifier"], r["split"]): r for r in f["classifiers"]}
    assert set(quality) == {("hard", "test"), ("hard", "train")}
    assert quality["hard", "train"]["accuracy"] >= 0.85
    assert quality["hard", "train"]["n"] > quality["hard", "test"]["n"]
    assert [line.split(" (")[0] for line in f["classifiers_not_shown"]] == ["classifier unsure"]
    assert [g["met"] for g in report["goals"]] == [True, True, True]


def test_markdown_and_json_hold_the_same_numbers(run: tuple[Path, subprocess.CompletedProcess[str]],
                                                 report: dict[str, Any]) -> None:
    md = assert_same_numbers(run[0], "auto", report, goals=3)
    assert "Cost per 1,000 requests" in md and "hard prompts sent to small" in md
