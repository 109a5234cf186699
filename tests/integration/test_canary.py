"""Policy canaries on two gateway replicas sharing PostgreSQL: the same slice everywhere, every answer naming the
version that decided it, automatic promotion and rollback, a replica restarting in the middle, an abort."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from switchyard.store import db
from switchyard.store.models import AuditEvent, RequestLogEntry
from tests.integration.conftest import Engines, Gateway, eventually, http_json, start_gateway, stop

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TENANTS = [f"co-{i}" for i in range(8)]
pytestmark = pytest.mark.postgres


class Pair:
    def __init__(self, engines: Engines, tmp: Path, url: str) -> None:
        self.engines, self.tmp, self.url = engines, tmp, url
        self.env = {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_ADMIN_TOKEN": TOKEN,
                    "SWITCHYARD_POLICY_POLL_INTERVAL_S": "5", "SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.2"}
        self.a = start_gateway(engines, url, tmp / "a", "postgresql", self.env)
        self.b = start_gateway(engines, url, tmp / "b", "postgresql", self.env)
        self.keys = {t: self.a.new_key(t, "pro") for t in TENANTS}
        self.base_text = engines.policy_file.read_text()

    def restart_b(self) -> None:
        assert stop(self.b.proc)
        self.b = start_gateway(self.engines, self.url, self.tmp / "b", "postgresql", self.env)

    def close(self) -> None:
        stop(self.a.proc)
        stop(self.b.proc)


@pytest.fixture(scope="module")
def pair(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
         pg_database: Callable[[], str]) -> Iterator[Pair]:
    p = Pair(engines, tmp_path_factory.mktemp("canary"), pg_database())
    try:
        yield p
    finally:
        p.close()


def ask(gw: Gateway, key: str) -> tuple[int, str | None]:
    """One chat request; its status and the version its route header names."""
    status, headers, _ = http_json("POST", gw.base_url + "/v1/chat/completions",
                                   {"model": "small", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                                   {"Authorization": f"Bearer {key}"})
    found = dict(part.split("=", 1) for part in headers.get("x-switchyard-route", "").split("; ") if "=" in part)
    return status, found.get("policy")


def traffic(pair: Pair, n: int) -> list[tuple[str, str, int, str | None]]:
    """``n`` requests spread over both replicas and every tenant: (replica, tenant, status, version)."""
    jobs = [(gw_name, tenant) for i in range(n) for gw_name, tenant in
            [("a" if i % 2 else "b", TENANTS[i % len(TENANTS)])]]

    def one(job: tuple[str, str]) -> tuple[str, str, int, str | None]:
        gw = pair.a if job[0] == "a" else pair.b
        return (job[0], job[1], *ask(gw, pair.keys[job[1]]))

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, jobs))


def start(pair: Pair, text: str, rollout: dict[str, Any]) -> dict[str, Any]:
    status, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/canary",
                                {"yaml": text, "rollout": rollout, "message": "test"}, AUTH)
    assert status == 201, body
    return dict(body)


def canary_status(pair: Pair) -> dict[str, Any]:
    status, _, body = http_json("GET", pair.b.base_url + "/admin/api/policy/canary", None, AUTH)
    assert status == 200, body
    return dict(body)


def served_canary(gw: Gateway) -> dict[str, Any] | None:
    body = http_json("GET", gw.base_url + "/readyz")[2]
    found: dict[str, Any] | None = body["checks"]["policy"]["canary"]
    return found


def variant(text: str, n: int) -> str:
    return re.sub(r"standard: \{max_queue_ms: \d+\}", f"standard: {{max_queue_ms: {1000 + n}}}", text)


def audit(pair: Pair, action: str) -> list[AuditEvent]:
    engine = db.create_db_engine(pair.url)
    try:
        with db.session_scope(engine) as session:
            return list(session.exec(select(AuditEvent).where(AuditEvent.action == action)
                                     .order_by(col(AuditEvent.id))).all())
    finally:
        engine.dispose()


def test_both_replicas_serve_the_same_slice_and_name_the_deciding_version(pair: Pair) -> None:
    started = start(pair, variant(pair.base_text, 1),
                    {"steps": [{"percent": 50, "hold": "10m"}, {"percent": 80, "hold": "10m"}], "by": "tenant"})
    candidate, base = f"v{started['version']}", f"v{started['base']}"
    assert eventually(lambda: served_canary(pair.b) is not None, timeout=5)  # NOTIFY: within a second, not the 5 s poll
    results = traffic(pair, 160)
    assert all(status == 200 for _, _, status, _ in results)
    by_tenant: dict[str, set[str | None]] = {}
    for _, tenant, _, version in results:
        by_tenant.setdefault(tenant, set()).add(version)
    # One tenant's requests are all on one side, through either replica.
    assert all(len(versions) == 1 for versions in by_tenant.values()), by_tenant
    sides = Counter(next(iter(v)) for v in by_tenant.values())
    assert set(sides) <= {candidate, base} and sides[candidate] >= 1 and sides[base] >= 1, sides
    # The request log names the version and the part each request had; the figures came from both replicas.

    def logged() -> list[RequestLogEntry]:
        engine = db.create_db_engine(pair.url)
        try:
            with db.session_scope(engine) as session:
                return list(session.exec(select(RequestLogEntry).where(col(RequestLogEntry.canary).is_not(None)))
                            .all())
        finally:
            engine.dispose()

    rows = eventually(lambda: (found := logged()) and len(found) >= 160 and found)
    assert {(r.canary, f"v{r.policy_version}") for r in rows} == {("canary", candidate), ("control", base)}

    def counted(s: dict[str, Any]) -> int:
        both = s["figures"].get("*", {})
        return int(sum(side["requests"] for side in both.values()))

    # Both replicas' counts reach the status (each flushes every 2 s).
    status = eventually(lambda: (s := canary_status(pair)) and len(s["replicas"]) == 2 and counted(s) >= 160 and s,
                        timeout=15)
    assert status and status["status"] == "running" and status["percent"] == 50
    assert counted(status) >= 160
    # Aborted in the middle of its first step.
    assert status["next"]["action"] == "hold" and status["step"] == 1 and status["next"]["in_s"] > 500
    status_code, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/canary/abort",
                                     {"reason": "done looking"}, AUTH)
    assert status_code == 200 and body["status"] == "aborted"
    assert eventually(lambda: served_canary(pair.b) is None, timeout=5)
    assert {v for _, _, _, v in traffic(pair, 16)} == {base}
    assert audit(pair, "policy.canary.abort")[-1].detail["reason"] == "done looking"


def test_a_canary_passes_its_steps_and_is_promoted(pair: Pair) -> None:
    started = start(pair, variant(pair.base_text, 2),
                    {"steps": [{"percent": 30, "hold": "1s"}, {"percent": 60, "hold": "1s"}], "by": "request",
                     "min_requests": 20})
    candidate = f"v{started['version']}"
    deadline = time.monotonic() + 40
    while canary_status(pair)["status"] == "running":
        assert time.monotonic() < deadline, canary_status(pair)
        traffic(pair, 40)
    final = canary_status(pair)
    assert final["status"] == "promoted", final
    steps = [e.detail for e in audit(pair, "policy.canary.step") if e.detail["canary"] == started["id"]]
    assert [(s["from_percent"], s["to_percent"]) for s in steps] == [(30, 60)]
    assert eventually(lambda: http_json("GET", pair.b.base_url + "/readyz")[2]["checks"]["policy"]["version"]
                      == candidate, timeout=5)
    assert {v for _, _, _, v in traffic(pair, 16)} == {candidate}
    pair.base_text = variant(pair.base_text, 2)


def test_a_bad_candidate_is_rolled_back_and_a_restarted_replica_keeps_the_slice(pair: Pair) -> None:
    bad = pair.base_text.replace('- {name: pro, priority: standard, models: ["*"]}',
                                 '- {name: pro, priority: standard, models: ["*"], limits: {requests_per_minute: 1}}')
    assert bad != pair.base_text
    started = start(pair, bad, {"steps": [{"percent": 40, "hold": "10m"}, {"percent": 80, "hold": "10m"}],
                                "by": "request", "min_requests": 20, "guards": {"rate_limited_rate": 0.02},
                                "window": "1m"})
    candidate = f"v{started['version']}"
    assert eventually(lambda: served_canary(pair.b) is not None, timeout=5)
    pair.restart_b()  # in the middle of the canary: it reads the running canary at start-up
    assert (served_canary(pair.b) or {}).get("version") == started["version"]
    # Enough that the slice (~40%) holds more requests than there are tenants: some tenant's second is a 429.
    results = traffic(pair, 64)
    assert {v for _, _, _, v in results} <= {candidate, f"v{started['base']}"}
    assert any(s == 429 and v == candidate for _, _, s, v in results), results  # a refusal names its version too
    deadline = time.monotonic() + 30
    while canary_status(pair)["status"] == "running":
        assert time.monotonic() < deadline, canary_status(pair)
        traffic(pair, 40)
    final = canary_status(pair)
    assert final["status"] == "rolled_back", final
    assert "rate_limited_rate" in final["reason"]
    event = audit(pair, "policy.canary.rollback")[-1]
    assert event.detail["canary"] == started["id"] and event.detail["guards"]
    assert event.actor.startswith("canary@")
    assert eventually(lambda: served_canary(pair.a) is None and served_canary(pair.b) is None, timeout=5)
    after = traffic(pair, 16)
    assert {v for _, _, _, v in after} == {f"v{started['base']}"}
    assert all(s == 200 for _, _, s, _ in after)
    # Nothing half-done: the base version is still the active one.
    body = http_json("GET", pair.a.base_url + "/admin/api/policy", None, AUTH)[2]
    assert body["version"]["number"] == started["base"]
    print(json.dumps({"rolled_back_after_s": final["ended_at"], "reason": final["reason"]}))


def test_one_canary_at_a_time_and_a_publish_supersedes_it(pair: Pair) -> None:
    started = start(pair, variant(pair.base_text, 3), {"percent": 10})
    status, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/canary",
                                {"yaml": variant(pair.base_text, 4), "rollout": {"percent": 10}}, AUTH)
    assert status == 409 and body["error"]["code"] == "canary_conflict"
    status, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/canary",
                                {"yaml": variant(pair.base_text, 4), "rollout": {"percent": 150}}, AUTH)
    assert status == 422 and "percent" in body["error"]["message"]
    status, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/versions",
                                {"yaml": variant(pair.base_text, 5), "message": "urgent fix"}, AUTH)
    assert status == 201
    final = canary_status(pair)
    assert final["id"] == started["id"] and final["status"] == "aborted"
    assert final["reason"] == f"superseded by the publish of v{body['version']['number']}"
    assert eventually(lambda: served_canary(pair.b) is None, timeout=5)


def test_the_api_takes_the_rollout_as_fields_of_the_body_too(pair: Pair) -> None:
    status, _, body = http_json("POST", pair.a.base_url + "/admin/api/policy/canary",
                                {"yaml": variant(pair.base_text, 6), "percent": 5, "by": "key", "mode": "shadow",
                                 "guards": {"error_rate": "+1%", "ttft": "1.5x"}}, AUTH)
    assert status == 201, body
    assert (body["mode"], body["by"], body["percent"], body["guards"]) == (
        "shadow", "key", 5, {"error_rate": 0.01, "ttft_p99": 1.5})
    status, _, refused = http_json("POST", pair.a.base_url + "/admin/api/policy/canary",
                                   {"version": body["version"], "percent": 5, "rollout": {"percent": 5}}, AUTH)
    assert status == 422 and refused["error"]["code"] == "invalid_rollout"
    assert http_json("POST", pair.a.base_url + "/admin/api/policy/canary/abort", None, AUTH)[0] == 200
