"""Several gateway processes on one database follow every publish; reloads under load lose nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.procs import Processes
from switchyard.bench.scenarios.base import BenchOptions, ScenarioContext
from switchyard.bench.scenarios.reload import Reload, analyse
from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop

TOKEN = "test-admin-token"
#: Only catches "never": the measured figure is printed (and the bench's reload scenario reports it).
GENEROUS_S = 5.0


def version(gw: Gateway) -> str:
    body: dict[str, Any] = http_json("GET", f"{gw.base_url}/readyz")[2]
    return str(body["checks"]["policy"]["version"])


def publish(gw: Gateway, text: str) -> int:
    status, _, body = http_json("POST", f"{gw.base_url}/admin/api/policy/versions",
                                {"yaml": text, "message": "test"}, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 201, body
    return int(body["version"]["number"])


@pytest.mark.postgres
def test_a_publish_through_one_replica_reaches_the_other_within_a_second(
        engines: Engines, tmp_path: Path, pg_database: Callable[[], str]) -> None:
    url = pg_database()
    env = {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_ADMIN_TOKEN": TOKEN,
           "SWITCHYARD_POLICY_POLL_INTERVAL_S": "30"}  # a long poll: only NOTIFY can be this fast
    a = start_gateway(engines, url, tmp_path / "a", "postgresql", env)
    b = start_gateway(engines, url, tmp_path / "b", "postgresql", env)
    try:
        assert version(a) == version(b) == "v1"
        good = engines.policy_file.read_text()
        delays = []
        for n in range(2, 7):
            number = publish(a, good.replace("standard: {max_queue_ms: 1000}", f"standard: {{max_queue_ms: {n}}}"))
            assert number == n and version(a) == f"v{n}"  # the replica published through serves it at once
            started = time.monotonic()
            while version(b) != f"v{n}":
                assert time.monotonic() - started < GENEROUS_S, f"replica B never served v{n}"
                time.sleep(0.005)
            delays.append(time.monotonic() - started)
        print(f"publish → other replica: {', '.join(f'{1000 * d:.0f} ms' for d in delays)}")
        metrics = http_json("GET", f"{b.base_url}/metrics")[2]
        assert "switchyard_policy_active_version 6.0" in metrics
        assert http_json("GET", f"{b.base_url}/readyz")[2]["checks"]["policy"]["listening"] is True
    finally:
        assert stop(a.proc) and stop(b.proc)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_fifty_publishes_and_rollbacks_under_load_fail_no_request(
        backend: str, tmp_path: Path, pg_database: Callable[[], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's reload scenario at full strength: 120 requests/s over two replicas, 50 changes."""
    if backend == "postgresql":
        monkeypatch.setenv("SWITCHYARD_DATABASE_URL", pg_database())
    else:
        monkeypatch.delenv("SWITCHYARD_DATABASE_URL", raising=False)
    with Processes(tmp_path / "logs") as procs:
        ctx = ScenarioContext(BenchOptions(out_dir=tmp_path, duration_s=14.0, progress=False), tmp_path, procs,
                              say=lambda _line: None)
        run = Reload(ctx)
        run.publishes = 50
        run.run()
    a = analyse(run)
    assert a["published"] == 50 and a["missed_b"] == 0
    assert a["requests"] >= 100 * 14 * 0.8  # at least 100 requests/s, give or take Poisson
    assert a["failed"] == 0, a["failure_kinds"]
    assert a["misversioned"] == 0
    served = {r.route_fields.get("policy") for results in run.results.values() for r in results}
    assert len(served) > 10, "the load must have met many versions"
    print(f"{backend}: {a['requests']} requests, 50 changes; to the other replica max "
          f"{1000 * max(a['to_b']):.0f} ms")
