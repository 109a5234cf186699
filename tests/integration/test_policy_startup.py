"""What a gateway serves at start-up: a bad document never replaces a good one."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sqlalchemy import text

from switchyard.store import db
from tests.integration.conftest import SWITCHYARD, Engines, http_json, start_gateway, stop


def _versions(database_url: str) -> list[tuple[int, str, bool]]:
    engine = db.create_db_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT number, source, active FROM policy_version ORDER BY number")).all()
    finally:
        engine.dispose()
    return [(r.number, r.source, bool(r.active)) for r in rows]


def test_file_versions_and_last_good_policy(engines: Engines, tmp_path: Path, database_url: str) -> None:
    policy = tmp_path / "policies.yaml"
    good = engines.policy_file.read_text()
    policy.write_text(good)
    files = Engines(policy, engines.ports, engines.dead_port)

    gw = start_gateway(files, database_url, tmp_path, "x")
    assert stop(gw.proc)
    gw = start_gateway(files, database_url, tmp_path, "x")  # same content: not a new version
    assert stop(gw.proc)
    assert _versions(database_url) == [(1, "file", True)]

    policy.write_text(good.replace("sheddable: {max_queue_ms: 100}", "sheddable: {max_queue_ms: 150}"))
    gw = start_gateway(files, database_url, tmp_path, "x")
    assert http_json("GET", f"{gw.base_url}/readyz")[2]["checks"]["policy"]["version"] == "v2"
    assert stop(gw.proc)
    assert _versions(database_url) == [(1, "file", False), (2, "file", True)]

    # A broken file: the last good version (v2) keeps serving, the errors are visible.
    policy.write_text(good.replace("priority: sheddable", "priority: shedable"))
    gw = start_gateway(files, database_url, tmp_path, "x")
    try:
        status, _, body = http_json("GET", f"{gw.base_url}/readyz")
        assert status == 200
        assert body["checks"]["policy"]["version"] == "v2"
        rejected = body["checks"]["policy"]["rejected"]
        assert rejected["source"] == "file"
        (error,) = rejected["errors"]
        assert "tiers[free].priority: unknown priority class 'shedable'" in error
        assert f"({policy}:" in error
        page = gw.console("viewer").get("/admin/").text
        assert 'id="policy-error"' in page and "shedable" in page
    finally:
        assert stop(gw.proc)
    assert _versions(database_url)[-1] == (2, "file", True)


def test_no_valid_policy_anywhere_refuses_to_start(tmp_path: Path, engines: Engines) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(engines.policy_file.read_text().replace("regions: [us-east, eu-west]", "regions: []"))
    env = {"SWITCHYARD_DATA_DIR": str(tmp_path), "SWITCHYARD_POLICY_FILE": str(policy), "SWITCHYARD_PORT": "0",
           "PATH": "/usr/bin:/bin"}
    result = subprocess.run([SWITCHYARD, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "regions: must not be empty" in result.stderr
    assert f"({policy}:2)" in result.stderr


def test_db_source_bootstraps_then_ignores_the_file(engines: Engines, tmp_path: Path, database_url: str) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(engines.policy_file.read_text())
    files = Engines(policy, engines.ports, engines.dead_port)
    env = {"SWITCHYARD_POLICY_SOURCE": "db"}
    gw = start_gateway(files, database_url, tmp_path, "x", env)
    assert stop(gw.proc)
    assert _versions(database_url) == [(1, "file", True)]
    policy.write_text("this is: [not a policy")
    gw = start_gateway(files, database_url, tmp_path, "x", env)
    try:
        body = http_json("GET", f"{gw.base_url}/readyz")[2]
        assert body["checks"]["policy"]["version"] == "v1"
        assert "rejected" not in body["checks"]["policy"], "in db mode the file is not the truth"
    finally:
        assert stop(gw.proc)
