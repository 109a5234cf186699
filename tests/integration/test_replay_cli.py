"""`switchyard policy replay` as an operator runs it before publishing (real subprocesses)."""

from __future__ import annotations

import json
import os
import random
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from switchyard.decide import canary as rules
from switchyard.policy import policy_sha256
from switchyard.policy.rollout import Rollout
from switchyard.store import canary as canary_store
from switchyard.store import db
from switchyard.store.models import RequestLogEntry
from switchyard.store.policy_versions import record_version
from tests.integration.conftest import SWITCHYARD

ROOT = Path(__file__).resolve().parents[2]
POLICY = (ROOT / "policies.yaml").read_text()


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWITCHYARD_DATA_DIR": str(tmp / "data"),
           "SWITCHYARD_POLICY_FILE": str(ROOT / "policies.yaml")}
    return subprocess.run([SWITCHYARD, "policy", "replay", *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp, env=env)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Azure-format trace of 300 requests over 60 s, and a candidate that keeps long prompts off large."""
    tmp = tmp_path_factory.mktemp("replay")
    rng = random.Random(5)
    rows, t = ["TIMESTAMP,ContextTokens,GeneratedTokens"], 0.0
    for _ in range(300):
        t += rng.expovariate(5.0)
        seconds = int(t)
        rows.append(f"2023-11-16 18:{15 + seconds // 60:02d}:{seconds % 60:02d}.{int((t % 1) * 1e7):07d},"
                    f"{rng.randint(50, 1200)},{rng.randint(10, 200)}")
    (tmp / "trace.csv").write_text("\n".join(rows) + "\n")
    candidate = POLICY.replace("when: {classifier: hard}", "when: {classifier: hard, prompt_tokens_lt: 900}")
    assert candidate != POLICY, "the demo policy's hard rule changed: update this candidate"
    (tmp / "cand.yaml").write_text(candidate)
    return tmp


def test_a_candidate_is_replayed_against_the_active_policy(files: Path) -> None:
    out = files / "report"
    result = run(files, "cand.yaml", "--trace", "trace.csv", "--tier", "free=2", "--tier", "pro", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text() == result.stdout.rstrip("\n") + "\n"
    active, candidate = report["arms"]
    assert active["requests"] == candidate["requests"] == 300
    # The demo's free tier allows 20 requests a minute: the trace's free tenant meets its limit.
    free = next(r for r in report["refusals"] if r["tier"] == "free")
    assert free["active_429"] > 0 and active["served"] == 300 - free["active_429"]
    assert active["statuses"]["429"] == free["active_429"]
    assert active["sha256"] == policy_sha256(POLICY)
    changes = report["changes"]
    # The trace's synthetic prompts (long runs of technical words) score as hard; those of 900 tokens
    # or more now go to medium instead of large: cheaper, and they change model.
    assert 0 < changes["model_changed"] < 300
    assert candidate["cost_per_1000"] < active["cost_per_1000"]
    assert {r["tier"] for r in report["refusals"]} == {"free", "pro"}
    assert {r["class"] for r in report["ttft"]} == {"sheddable", "standard"}
    assert f"**{changes['any_changed']} of 300 requests change placement**" in result.stdout
    assert active["simulated_s"] > 50  # the trace's minute, in simulated time


def test_an_invalid_candidate_is_refused_with_its_location(files: Path) -> None:
    (files / "bad.yaml").write_text(POLICY.replace("default: medium", "default: mediun"))
    result = run(files, "bad.yaml", "--trace", "trace.csv")
    assert result.returncode == 1
    assert "invalid policy bad.yaml" in result.stderr and "routes[auto].default" in result.stderr
    assert "bad.yaml:" in result.stderr


def test_stored_versions_can_be_compared(files: Path, tmp_path: Path) -> None:
    engine = db.create_db_engine(f"sqlite:///{tmp_path / 'data' / 'switchyard.db'}")
    db.upgrade(engine)
    with db.session_scope(engine) as session:
        record_version(session, text=POLICY, sha256=policy_sha256(POLICY), source="file", author="test")
    engine.dispose()
    (tmp_path / "trace.csv").write_text((files / "trace.csv").read_text())
    (tmp_path / "cand.yaml").write_text((files / "cand.yaml").read_text())
    result = run(tmp_path, "cand.yaml", "--against", "v1", "--trace", "trace.csv", "--limit", "50", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["arms"][0]["policy"] == "v1" and report["arms"][1]["requests"] == 50
    missing = run(tmp_path, "cand.yaml", "--against", "v9", "--trace", "trace.csv")
    assert missing.returncode == 1 and "no policy version 9" in missing.stderr


def _log_db(tmp: Path, entries: list[dict[str, object]]) -> None:
    """The embedded database of ``tmp``, migrated, with ``entries`` in its request log."""
    engine = db.create_db_engine(f"sqlite:///{tmp / 'data' / 'switchyard.db'}")
    db.upgrade(engine)
    with db.session_scope(engine) as session:
        for i, fields in enumerate(entries):
            session.add(RequestLogEntry(request_id=f"r{i}", replica="test:1", outcome="ok", detail="{}",
                                        **fields))  # type: ignore[arg-type]
    engine.dispose()


def test_the_request_log_is_replayed_with_each_requests_own_tier_and_lengths(tmp_path: Path) -> None:
    """A minute of free-tier traffic (a request a second) meets the demo's 20 requests/minute limit; a
    candidate that raises it would have served all of it. Entries of another hour, or with no tier, are not
    replayed."""
    now = datetime.now(UTC)
    start = now - timedelta(minutes=5)
    entries: list[dict[str, object]] = []
    for i in range(60):
        ran = i < 20
        entries.append({"at": start + timedelta(seconds=i), "kind": "chat", "tier": "free", "model": "small",
                        "status": 200 if ran else 429, "stream": False, "prompt_tokens": 200 + i,
                        "completion_tokens": 20 if ran else None, "max_tokens": 20})
    entries.append({"at": start, "kind": "chat", "tier": None, "model": "small", "status": 401, "stream": False})
    entries.append({"at": now - timedelta(hours=3), "kind": "chat", "tier": "pro", "model": "small",
                    "status": 200, "stream": False, "prompt_tokens": 100, "completion_tokens": 10})
    _log_db(tmp_path, entries)
    raised = POLICY.replace("requests_per_minute: 20,", "requests_per_minute: 100,")
    assert raised != POLICY, "the demo policy's free tier changed: update this candidate"
    (tmp_path / "raised.yaml").write_text(raised)
    result = run(tmp_path, "raised.yaml", "--from-log", "--since", "60", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    source = report["workload"]
    assert source["source"] == "request log" and source["entries"] == 61 and source["requests"] == 60
    assert source["skipped"]["no_tier"] == 1 and source["refused_in_log"] == 40
    [free] = report["refusals"]
    assert (free["tier"], free["requests"], free["candidate_429"]) == ("free", 60, 0)
    # The limiter refills as the minute goes (one request every 3 s): about 60 - 20 - 60/3 are refused.
    assert 15 <= free["active_429"] <= 25
    active, candidate = report["arms"]
    assert active["served"] == 60 - free["active_429"] and candidate["served"] == 60
    # Every replayed prompt has the logged length (the chat template included).
    assert candidate["prompt_tokens"] == sum(200 + i for i in range(60))
    assert candidate["output_tokens"] == 60 * 20
    both = run(tmp_path, "raised.yaml", "--from-log", "--trace", "raised.yaml")
    assert both.returncode == 2 and "exactly one of --trace FILE and --from-log" in both.stderr
    tiers = run(tmp_path, "raised.yaml", "--from-log", "--tier", "pro")
    assert tiers.returncode == 2 and "keeps its own tier" in tiers.stderr


def test_an_empty_request_log_is_said_plainly(tmp_path: Path) -> None:
    _log_db(tmp_path, [])
    result = run(tmp_path, str(ROOT / "policies.yaml"), "--from-log", "--since", "5")
    assert result.returncode == 1 and "the request log of the last 5 minutes: no requests to replay" in result.stderr


def _canary_db(tmp: Path, candidate: str, rollout: Rollout) -> int:
    """The embedded database of ``tmp`` with the demo policy active (v1) and a canary of ``candidate`` (v2)
    running; the canary's id."""
    engine = db.create_db_engine(f"sqlite:///{tmp / 'data' / 'switchyard.db'}")
    db.upgrade(engine)
    with db.session_scope(engine) as session:
        record_version(session, text=POLICY, sha256=policy_sha256(POLICY), source="file", author="test")
        row = canary_store.start(session, rollout, author="test", origin="test", text=candidate)
        assert row.id is not None
        canary_id = row.id
    engine.dispose()
    return canary_id


def test_the_running_canary_is_replayed_its_candidate_deciding_its_slice(files: Path, tmp_path: Path) -> None:
    """`--canary`: the running canary's candidate (v2) decides the requests of its slice, hashed as the gateway
    hashes them and salted with the canary's id, at its step's percentage; the active version (v1) the rest."""
    canary_id = _canary_db(tmp_path, (files / "cand.yaml").read_text(), Rollout(percent=30, by="request"))
    (tmp_path / "trace.csv").write_text((files / "trace.csv").read_text())
    (tmp_path / "cand.yaml").write_text((files / "cand.yaml").read_text())
    result = run(tmp_path, "--canary", "--trace", "trace.csv", "--tier", "pro", "--limit", "200", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    canary = report["canary"]
    decided = sum(rules.in_slice(canary_id, 30, f"r:replay-{i}") for i in range(200))
    assert (canary["candidate"], canary["percent"], canary["by"], canary["salt"]) == ("v2", 30, "request", canary_id)
    assert (canary["requests"], canary["in_scope"], canary["candidate_decided"]) == (200, 200, decided)
    assert 30 < decided < 90
    active, arm = report["arms"]
    assert (active["policy"], arm["policy"], arm["name"]) == ("v1", "v2 canary (30% by request)", "canary")
    # The slice's own changes are among the whole replay's (the rest, decided by v1, may move too: it shares
    # the fleet with a slice whose requests went elsewhere).
    assert 0 < canary["slice"]["changes"]["model_changed"] <= report["changes"]["model_changed"]
    assert canary["slice"]["changes"]["requests"] == decided
    markdown = run(tmp_path, "--canary", "--trace", "trace.csv", "--tier", "pro", "--limit", "200")
    assert f"**v2 decided {decided} of 200 requests**" in markdown.stdout

    # By tenant, a trace's tenant is its tier: the whole tier is on one side.
    both = run(tmp_path, "cand.yaml", "--trace", "trace.csv", "--tier", "free", "--tier", "pro", "--limit", "100",
               "--canary-percent", "50", "--canary-salt", "3", "--canary-tier", "pro", "--json")
    assert both.returncode == 0, both.stderr
    tiers = {r["tier"]: r["requests"] for r in json.loads(both.stdout)["refusals"]}
    expected = tiers["pro"] if rules.in_slice(3, 50, "t:pro") else 0
    sliced = json.loads(both.stdout)["canary"]
    assert (sliced["in_scope"], sliced["candidate_decided"]) == (tiers["pro"], expected)
    assert sliced["only"]["tiers"] == ["pro"] and sliced["salt"] == 3


def test_canary_options_are_checked(files: Path, tmp_path: Path) -> None:
    (tmp_path / "trace.csv").write_text((files / "trace.csv").read_text())
    (tmp_path / "cand.yaml").write_text((files / "cand.yaml").read_text())
    for args, message in ((["cand.yaml", "--canary"], "give no CANDIDATE"),
                          (["--canary", "--canary-percent", "5"], "give no CANDIDATE and no --canary-* option"),
                          (["cand.yaml", "--canary-by", "key"], "shape a canary of --canary-percent"),
                          ([], "give a CANDIDATE")):
        result = run(tmp_path, *args, "--trace", "trace.csv")
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    none = run(tmp_path, "--canary", "--trace", "trace.csv")
    assert none.returncode == 1 and "no canary runs" in none.stderr
    full = run(tmp_path, "cand.yaml", "--trace", "trace.csv", "--canary-percent", "100")
    assert full.returncode == 2 and "--canary-percent" in full.stderr


def test_a_canary_replayed_from_the_log_takes_the_slice_the_gateway_took(tmp_path: Path) -> None:
    """Logged requests keep their tenant's id: by tenant, each tenant's requests are all on one side, the side
    the gateway's hash of that id puts them."""
    start = datetime.now(UTC) - timedelta(minutes=5)
    _log_db(tmp_path, [{"at": start + timedelta(seconds=i * 0.5), "kind": "chat", "tier": "pro", "model": "auto",
                        "status": 200, "stream": False, "prompt_tokens": 150 + i, "completion_tokens": 10,
                        "max_tokens": 10, "tenant_id": i % 12, "key_id": 50 + i % 12} for i in range(96)])
    (tmp_path / "cand.yaml").write_text(POLICY.replace("requests_per_minute: 20,", "requests_per_minute: 100,"))
    result = run(tmp_path, "cand.yaml", "--from-log", "--canary-percent", "50", "--canary-salt", "4", "--json")
    assert result.returncode == 0, result.stderr
    canary = json.loads(result.stdout)["canary"]
    tenants_in = [t for t in range(12) if rules.in_slice(4, 50, f"t:{t}")]
    assert 0 < len(tenants_in) < 12
    assert (canary["in_scope"], canary["candidate_decided"]) == (96, 8 * len(tenants_in))
