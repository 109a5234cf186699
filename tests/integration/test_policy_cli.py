"""`switchyard policy publish|rollback|history|diff|export|audit` against real databases."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from switchyard.cli import main
from switchyard.policy import compile_policy
from tests.integration.conftest import SWITCHYARD
from tests.unit.policy.base import base, to_yaml


def _env(tmp_path: Path, database_url: str, source: str = "db") -> dict[str, str | None]:
    policy = tmp_path / "policies.yaml"
    if not policy.exists():
        policy.write_text(to_yaml(base()))
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SWITCHYARD_")}
    env.update({"SWITCHYARD_DATA_DIR": str(tmp_path), "SWITCHYARD_DATABASE_URL": database_url,
                "SWITCHYARD_POLICY_FILE": str(policy), "SWITCHYARD_POLICY_SOURCE": source})
    return env


class Cli:
    """The `switchyard` command, run in this process with a fixed environment."""

    def __init__(self, env: dict[str, str | None]) -> None:
        self.env = env
        self.runner = CliRunner()

    def __call__(self, *args: str, code: int = 0) -> Result:
        result = self.runner.invoke(main, list(args), env=self.env)
        assert result.exit_code == code, (args, result.output, result.exception)
        return result


@pytest.fixture
def cli(tmp_path: Path, database_url: str) -> Cli:
    run = Cli(_env(tmp_path, database_url))
    run("db", "upgrade")
    return run


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(to_yaml(doc))
    return path


def test_publish_history_diff_rollback_and_audit(cli: Cli, tmp_path: Path) -> None:
    v1 = _write(tmp_path / "v1.yaml", base())
    doc = base()
    doc["tiers"][0]["limits"]["tokens_per_day"] = 5000
    v2 = _write(tmp_path / "v2.yaml", doc)
    user = f"cli:{getpass.getuser()}"

    assert cli("policy", "publish", str(v1), "-m", "first").stdout.startswith("published v1 (parent none, sha256 ")
    assert "no change" in cli("policy", "publish", str(v1)).stdout
    assert cli("policy", "publish", str(v2), "--author", "alice").stdout.startswith("published v2 (parent v1,")

    history = json.loads(cli("policy", "history", "--json").stdout)
    assert [(h["number"], h["parent"], h["active"], h["source"], h["author"], h["message"]) for h in history] == [
        (2, 1, True, "cli", "alice", ""), (1, None, False, "cli", user, "first")]
    listing = cli("policy", "history").stdout.splitlines()
    assert listing[0].startswith("* v2") and listing[1].startswith("  v1")

    shown = cli("policy", "diff", "1", "v2").stdout
    assert shown.startswith("tier free: limits.tokens_per_day 10000 → 5000\n\n--- v1\n+++ v2\n")
    as_json = json.loads(cli("policy", "diff", "v1", "active", "--json").stdout)
    assert (as_json["from"], as_json["to"], as_json["changes"]) == (
        "v1", "v2", ["tier free: limits.tokens_per_day 10000 → 5000"])
    assert cli("policy", "diff", "active", str(v2)).stdout.startswith("no semantic change\n")

    assert cli("policy", "rollback", "1").stdout == "rolled back: v3 is active, with the content of v1\n"
    assert "already active" in cli("policy", "rollback", "1").stdout
    assert "no policy version 7" in cli("policy", "rollback", "7", code=1).stderr

    audit = json.loads(cli("policy", "audit", "--json").stdout)
    assert [(a["action"], a["target"], a["actor"]) for a in audit] == [
        ("policy.rollback", "policy:v3", user), ("policy.publish", "policy:v2", "alice"),
        ("policy.publish", "policy:v1", user)]
    assert all(a["origin"].startswith("cli ") for a in audit)
    assert "policy.rollback  policy:v3" in cli("policy", "audit", "--limit", "1").stdout


def test_an_invalid_document_is_refused_line_by_line_and_nothing_is_written(cli: Cli, tmp_path: Path) -> None:
    doc = base()
    doc["pools"][0]["region"] = "us-esat"
    doc["tiers"][0]["priority"] = "nope"
    bad = _write(tmp_path / "bad.yaml", doc)
    result = cli("policy", "publish", str(bad), code=1)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("pools[small-us].region: unknown region 'us-esat'") and f"({bad}:7)" in lines[0]
    assert lines[1].startswith("tiers[free].priority: unknown priority class 'nope'") and f"({bad}:" in lines[1]
    doc = base()
    doc["tests"][0]["expect"]["model"] = "large"
    failing = _write(tmp_path / "failing.yaml", doc)
    (line,) = cli("policy", "publish", str(failing), code=1).stdout.strip().splitlines()
    assert line.startswith("tests[hi is small].expect: policy test 'hi is small' failed: expected model large, got "
                           "status 200, model small, pool small-us, region us-east (")
    assert json.loads(cli("policy", "history", "--json").stdout) == []
    assert json.loads(cli("policy", "audit", "--json").stdout) == []


def test_export_writes_the_stored_text_and_updates_an_operators_file_in_place(cli: Cli, tmp_path: Path) -> None:
    commented = "# Reviewed by the platform team.\n" + to_yaml(base()).replace(
        "  limits:\n", "  limits:   # per tenant\n")
    published = tmp_path / "published.yaml"
    published.write_text(commented)
    cli("policy", "publish", str(published))
    doc = base()
    doc["tiers"][0]["limits"]["tokens_per_day"] = 5000
    cli("policy", "publish", str(_write(tmp_path / "v2.yaml", doc)))

    assert cli("policy", "export", "--version", "1").stdout == commented  # comments and all
    fresh = tmp_path / "out" / "fresh.yaml"
    fresh.parent.mkdir()
    assert "wrote v2" in cli("policy", "export", "-o", str(fresh)).stderr
    assert fresh.read_text() == to_yaml(doc)

    result = cli("policy", "export", "--onto", str(published))
    assert "updated" in result.stderr and "comments and key order kept" in result.stderr
    assert published.read_text() == commented.replace("tokens_per_day: 10000", "tokens_per_day: 5000")
    assert "unchanged" in cli("policy", "export", "-o", str(published)).stderr
    link = tmp_path / "link.yaml"
    link.symlink_to(published)
    cli("policy", "export", "--version", "1", "--onto", str(link))
    assert link.is_symlink() and published.read_text() == commented  # the file behind the link was updated
    assert "cannot write" in cli("policy", "export", "-o", str(tmp_path / "no" / "such.yaml"), code=1).stderr
    assert cli("policy", "export", "--onto", str(tmp_path / "missing.yaml"), code=2).exit_code == 2
    assert "no policy version 9" in cli("policy", "export", "--version", "9", code=1).stderr


def test_diff_of_two_files_needs_no_database(tmp_path: Path) -> None:
    cli = Cli(_env(tmp_path, f"sqlite:///{tmp_path / 'never-created.db'}"))
    doc = base()
    del doc["routes"][0]
    a, b = _write(tmp_path / "a.yaml", base()), tmp_path / "b.yaml"
    _write(b, doc)
    assert cli("policy", "diff", str(a), str(b)).stdout.startswith("route auto: removed\n\n--- ")
    assert not (tmp_path / "never-created.db").exists()
    assert "invalid YAML" in cli("policy", "diff", str(a), str(_broken(tmp_path)), code=1).stdout


def _broken(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text("schema: [1\n")
    return path


def test_file_mode_refuses_publish_and_rollback(tmp_path: Path) -> None:
    """As a user runs it: a real process, exit 1 and a message saying why and what to do instead."""
    env = {k: v for k, v in _env(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", source="file").items() if v}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SWITCHYARD, *args], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", **env})

    assert run("db", "upgrade").returncode == 0
    for args in (("publish", env["SWITCHYARD_POLICY_FILE"]), ("rollback", "1")):
        result = run("policy", *args)
        assert result.returncode == 1, result.stderr
        assert "policy_source is file" in result.stderr and "SWITCHYARD_POLICY_SOURCE=db" in result.stderr
        assert "Traceback" not in result.stderr
    assert run("policy", "history", "--json").stdout.strip() == "[]"


def test_policy_test_runs_each_test_through_the_gateways_decisions(tmp_path: Path) -> None:
    demo = Path(__file__).resolve().parents[2] / "policies.yaml"
    passed = subprocess.run([SWITCHYARD, "policy", "test", str(demo)], capture_output=True, text=True, timeout=60)
    assert passed.returncode == 0, passed.stderr
    count = len(compile_policy(demo.read_text()).document.tests)
    assert count >= 6
    assert passed.stdout.strip().splitlines()[-1] == f"{count} passed, 0 failed"
    assert ("PASS long prompts go to medium, in us-east when the fleet is idle: expected status 200, model medium, "
            "pool medium-us, region us-east") in passed.stdout
    doc = base()
    doc["tests"].append({"name": "eu please", "request": {"model": "small", "tier": "pro", "prompt_tokens": 50},
                         "expect": {"region": "eu-west"}})
    bad = tmp_path / "p.yaml"
    bad.write_text(to_yaml(doc))
    failed = subprocess.run([SWITCHYARD, "policy", "test", str(bad), "--json"], capture_output=True, text=True,
                            timeout=60)
    assert failed.returncode == 1
    report = json.loads(failed.stdout)
    assert (report["passed"], report["failed"]) == (1, 1)
    assert report["tests"][1] == {"name": "eu please", "passed": False, "expected": "region eu-west",
                                  "got": "status 200, model small, pool small-us, region us-east"}


def test_policy_test_runs_a_stored_versions_tests_against_that_version(cli: Cli, tmp_path: Path) -> None:
    """`policy test 7`, `v7` or `active` runs the tests of the version as it was published, against it."""
    cli("policy", "publish", str(_write(tmp_path / "v1.yaml", base())))
    doc = base()
    doc["routes"][0]["rules"][1]["model"] = "large"  # short prompts to large now
    doc["tests"] = [{"name": "hi is large", "request": {"model": "auto", "tier": "pro", "prompt": "hi"},
                     "expect": {"model": "large"}},
                    {"name": "small stays small", "request": {"model": "small", "tier": "pro", "prompt": "hi"},
                     "expect": {"model": "small"}}]
    cli("policy", "publish", str(_write(tmp_path / "v2.yaml", doc)))

    first = json.loads(cli("policy", "test", "v1", "--json").stdout)
    assert (first["policy"], first["passed"], first["failed"]) == ("v1", 1, 0)
    assert [t["name"] for t in first["tests"]] == ["hi is small"]
    for ref in ("2", "v2", "active"):
        second = json.loads(cli("policy", "test", ref, "--json").stdout)
        assert (second["policy"], second["passed"], second["failed"]) == ("v2", 2, 0), ref
        assert [t["name"] for t in second["tests"]] == ["hi is large", "small stays small"]
    shown = cli("policy", "test", "v1").stdout.splitlines()
    assert shown[0] == "policy tests of v1" and shown[-1] == "1 passed, 0 failed"
    assert "PASS hi is small: expected model small" in shown
    assert "no policy version 9" in cli("policy", "test", "v9", code=1).stderr
    # Anything else is a file, as before.
    as_file = json.loads(cli("policy", "test", str(tmp_path / "v2.yaml"), "--json").stdout)
    assert as_file["policy"] == str(tmp_path / "v2.yaml") and as_file["passed"] == 2
