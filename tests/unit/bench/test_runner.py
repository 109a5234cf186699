"""Process handling, the run's index report, and the ``switchyard bench`` command (no engines)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from switchyard.bench import runner
from switchyard.bench.procs import CpuMeter, Processes, StartError, wait_http
from switchyard.bench.scenarios import SCENARIOS, BenchOptions, Outcome, Scenario, ScenarioContext
from switchyard.bench.tables import goal, render_goal_row, render_row, table, text
from switchyard.cli import main
from tests.helpers import free_port


def test_processes_are_logged_and_stopped_on_exit(tmp_path: Path) -> None:
    with Processes(tmp_path / "logs") as procs:
        a = procs.start("sleeper", [sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(60)"])
        b = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        deadline = time.monotonic() + 10
        while "hello" not in a.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.log_path.name == "sleeper.log" and b.log_path.name == "sleeper-2.log"
        assert "hello" in a.log_tail()
        a.popen.send_signal(signal.SIGSTOP)  # even a paused process is stopped
    assert not a.alive() and not b.alive()
    assert procs.running() == []


def test_waiting_for_a_process_that_died_says_why(tmp_path: Path) -> None:
    with Processes(tmp_path) as procs:
        dead = procs.start("dies", [sys.executable, "-c", "import sys; print('no config'); sys.exit(3)"])
        with pytest.raises(StartError, match=r"dies exited with code 3(.|\n)*no config"):
            wait_http(f"http://127.0.0.1:{free_port()}/health", dead, 10)


def test_the_cpu_meter_splits_the_machine_between_the_bench_and_others(tmp_path: Path) -> None:
    with Processes(tmp_path) as procs:
        meter = CpuMeter(procs)
        meter.start()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        cpu = meter.stop()
    assert cpu is not None
    assert cpu["bench_share"] > 0 and cpu["others_share"] >= 0 and cpu["seconds"] >= 0.2


def _options(tmp_path: Path) -> BenchOptions:
    return BenchOptions(out_dir=tmp_path / "out", quick=True, progress=False)


@pytest.fixture
def future(monkeypatch: pytest.MonkeyPatch) -> str:
    """A scenario whose feature has not landed (every real one has)."""
    monkeypatch.setitem(SCENARIOS, "future", Scenario("future", "a later feature", issue=99,
                                                      missing="the later feature"))
    return "future"


def test_a_run_of_scenarios_that_have_not_landed_names_each_with_its_issue(tmp_path: Path, future: str) -> None:
    run = runner.run_bench(_options(tmp_path), [future], lambda _line: None)
    assert not run.failed
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["status"] for s in data["scenarios"]] == ["not_landed"]
    md = (tmp_path / "out" / "report.md").read_text()
    for name in {n for n, s in SCENARIOS.items() if not s.landed}:  # every one, chosen or not
        issue = SCENARIOS[name].issue
        assert any(line.startswith(f"- {name} (") and f"issue {issue}" in line for line in md.splitlines()), name


def test_a_scenario_that_raises_is_failed_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: ScenarioContext) -> Outcome:
        raise RuntimeError("no engine today")

    def fine(ctx: ScenarioContext) -> Outcome:
        data = table("T", [text("a", "a")], [{"a": "x"}])
        return Outcome("fine", "ok", "all good", [goal("g", "t", 1.0, True)], [data], None, notes=["n"])

    monkeypatch.setitem(SCENARIOS, "broken", Scenario("broken", "breaks", broken))
    monkeypatch.setitem(SCENARIOS, "fine", Scenario("fine", "works", fine))
    run = runner.run_bench(_options(tmp_path), ["broken", "fine"], lambda _line: None)
    assert [o.name for o in run.failed] == ["broken"]
    assert "no engine today" in (tmp_path / "out" / "logs" / "broken-error.log").read_text()
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    assert data["failed"] == ["broken"]
    assert "**Failed:** RuntimeError: no engine today" in md
    fine_data = data["scenarios"][1]
    assert render_goal_row(fine_data["goals"][0]) in md
    assert render_row(fine_data["tables"][0], fine_data["tables"][0]["rows"][0]) in md
    assert fine_data["cpu"]["seconds"] >= 0


def test_the_command_rejects_an_unknown_scenario(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "--scenario", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown scenario nope" in result.output


def test_the_command_prints_where_the_report_is(tmp_path: Path, future: str) -> None:
    out = tmp_path / "r"
    result = CliRunner().invoke(main, ["bench", "--scenario", future, "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output
    assert "future: not_landed" in result.output
    assert (out / "report.md").exists()
