"""Policy canaries on SQLite: a shadow canary started from the command line, and a policy file (GitOps mode) whose
``rollout:`` stanza makes a changed document go live as a canary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from switchyard.store import db
from switchyard.store.models import RequestLogEntry
from tests.integration.conftest import (
    Engines,
    Gateway,
    eventually,
    gateway_counter,
    http_json,
    start_gateway,
    stop,
)

FAST = {"SWITCHYARD_POLICY_POLL_INTERVAL_S": "0.3", "SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.2"}
SHORT_TO_SMALL = "- {name: short, when: {prompt_tokens_lt: 200}, model: small}"
PRO = '- {name: pro, priority: standard, models: ["*"]}'


def chat(gw: Gateway, model: str = "auto") -> tuple[int, dict[str, str]]:
    status, headers, _ = http_json("POST", gw.base_url + "/v1/chat/completions",
                                   {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                                   {"Authorization": f"Bearer {gw.keys['pro']}"})
    route = dict(p.split("=", 1) for p in headers.get("x-switchyard-route", "").split("; ") if "=" in p)
    return status, route | {"request_id": headers.get("x-request-id", "")}


def readyz_canary(gw: Gateway) -> dict[str, Any] | None:
    found: dict[str, Any] | None = http_json("GET", gw.base_url + "/readyz")[2]["checks"]["policy"]["canary"]
    return found


def status_of(gw: Gateway) -> dict[str, Any]:
    return dict(json.loads(gw.cli("policy", "canary", "status", "--json").stdout))


def test_a_shadow_canary_decides_alongside_and_counts_what_differs(engines: Engines, tmp_path: Path) -> None:
    base = engines.policy_file.read_text()
    assert SHORT_TO_SMALL in base
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text(base.replace(SHORT_TO_SMALL, SHORT_TO_SMALL.replace("model: small", "model: large"))
                         .replace("tier: free, prompt: hi}, expect: {model: small}",
                                  "tier: pro, prompt: hi}, expect: {model: large}"))
    url = f"sqlite:///{tmp_path / 'gw.db'}"
    gw = start_gateway(engines, url, tmp_path, "sqlite", {"SWITCHYARD_POLICY_SOURCE": "db", **FAST})
    try:
        gw.keys["pro"] = gw.new_key("shadow-co", "pro")
        out = gw.cli("policy", "canary", "start", str(candidate), "--shadow", "--by", "request").stdout
        assert "canary 1 started: v2" in out and "shadow" in out
        assert eventually(lambda: readyz_canary(gw), timeout=5)
        answers = [chat(gw) for _ in range(30)]
        # The active version served every request: the shadow only decided.
        assert {(s, r["policy"], r["model"]) for s, r in answers} == {(200, "v1", "small")}
        status = eventually(lambda: (s := http_json("GET", gw.base_url + "/admin/api/policy/canary")[2])
                            and s["shadow"]["decided"] >= 30 and s, timeout=10)
        assert status_of(gw)["shadow"] == status["shadow"]  # the command line reads the same
        assert status["mode"] == "shadow" and status["shadow"]["differences"] == {"model": 30}, status
        assert gateway_counter(gw, "switchyard_canary_shadow_differences_total", field="model") == 30
        assert gateway_counter(gw, "switchyard_canary_requests_total", role="shadow") == 30
        engine = db.create_db_engine(url)
        try:
            def logged() -> list[RequestLogEntry]:
                with db.session_scope(engine) as session:
                    return list(session.exec(select(RequestLogEntry)
                                             .where(col(RequestLogEntry.canary) == "shadow")).all())
            rows = eventually(lambda: (r := logged()) and len(r) == 30 and r)
            assert rows and all(json.loads(r.detail)["shadow"] == {"model": ["small", "large"]} for r in rows)
            assert {r.policy_version for r in rows} == {1}
        finally:
            engine.dispose()
        page = gw.console("viewer").get(f"/admin/requests/{answers[0][1]['request_id']}").text
        assert "Shadow would differ" in page and "model: small → large" in page and "v1" in page
        aborted = gw.cli("policy", "canary", "abort", "--reason", "seen enough").stdout
        assert "aborted: canary 1 of v2" in aborted
        assert eventually(lambda: readyz_canary(gw) is None, timeout=5)
        assert status_of(gw)["status"] == "aborted"
        refused = gw.cli("policy", "canary", "start", str(candidate), "--percent", "150", check=False)
        assert refused.returncode != 0 and "percent" in refused.stderr
    finally:
        assert stop(gw.proc)


def _rollout(steps: str, guards: str) -> str:
    return (f"\nrollout:\n  by: request\n  steps: {steps}\n  min_requests: 20\n  guards: {guards}\n"
            "  window: 1m\n")


def _until_done(gw: Gateway, timeout: float = 40) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = http_json("GET", gw.base_url + "/admin/api/policy/canary")[2]
        if status["status"] != "running":
            return dict(status)
        assert time.monotonic() < deadline, status
        for _ in range(20):
            chat(gw, "small")


def test_a_policy_file_with_a_rollout_stanza_goes_live_as_a_canary(engines: Engines, tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    base = engines.policy_file.read_text()
    policy.write_text(base)
    files = Engines(policy, engines.ports, engines.dead_port)
    url = f"sqlite:///{tmp_path / 'gw.db'}"
    gw = start_gateway(files, url, tmp_path, "sqlite", FAST)
    try:
        gw.keys["pro"] = gw.new_key("file-co", "pro")
        # A bad change: the pro tier's limit cut to 1 request a minute.
        bad = base.replace(PRO, PRO.replace("]}", '], limits: {requests_per_minute: 1}}'))
        assert bad != base
        policy.write_text(bad + _rollout("[{percent: 50, hold: 10m}]", "{rate_limited_rate: 0.02}"))
        started = eventually(lambda: readyz_canary(gw), timeout=10)
        assert started and started["version"] == 2 and started["percent"] == 50
        assert http_json("GET", gw.base_url + "/readyz")[2]["checks"]["policy"]["version"] == "v1"
        ended = _until_done(gw)
        assert ended["status"] == "rolled_back" and "rate_limited_rate" in ended["reason"], ended
        assert eventually(lambda: readyz_canary(gw) is None, timeout=5)
        assert {chat(gw, "small")[1]["policy"] for _ in range(5)} == {"v1"}
        # The same content is not rolled out again: not on a restart, not when the file is touched.
        assert stop(gw.proc)
        gw = _restart(gw, files, url, tmp_path)
        assert readyz_canary(gw) is None
        policy.touch()
        time.sleep(1.0)
        assert readyz_canary(gw) is None
        assert http_json("GET", gw.base_url + "/readyz")[2]["checks"]["policy"]["version"] == "v1"
        # A good change goes through its step and is promoted: the file's document is then the active version.
        good = base.replace("standard: {max_queue_ms: 1000}", "standard: {max_queue_ms: 1200}")
        policy.write_text(good + _rollout("[{percent: 50, hold: 1s}]", "{rate_limited_rate: 0.02, error_rate: 0.02}"))
        assert eventually(lambda: readyz_canary(gw), timeout=10)
        ended = _until_done(gw)
        assert ended["status"] == "promoted", ended
        assert eventually(lambda: http_json("GET", gw.base_url + "/readyz")[2]["checks"]["policy"]["version"]
                          == f"v{ended['version']}", timeout=5)
        assert "max_queue_ms: 1200" in http_json("GET", gw.base_url + "/admin/api/policy")[2]["text"]
    finally:
        stop(gw.proc)


def _restart(old: Gateway, files: Engines, url: str, tmp_path: Path) -> Gateway:
    gw = start_gateway(files, url, tmp_path, "sqlite", FAST)
    gw.keys.update(old.keys)
    return gw
