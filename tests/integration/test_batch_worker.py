"""Batch jobs run to the end: the official SDK's batch flow against a real gateway whose worker
dispatches the lines through the batch lane, and a crash test — workers killed with SIGKILL in the
middle of a batch of thousands of lines, restarted, and every line has exactly one result."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import text

from switchyard.store import db
from switchyard.store.key_changes import changing_keys
from switchyard.store.keys import revoke_key
from tests.integration.conftest import (
    SWITCHYARD,
    Engines,
    Gateway,
    endpoints,
    eventually,
    http_json,
    start_gateway,
    stop,
)

BATCH_CLASS = "  batch: {lane: batch}\n"


def _batch_policy(engines: Engines, path: Path) -> Path:
    """The test policy with a batch-lane class (the worker sends lines in it)."""
    text = engines.policy_file.read_text()
    at = text.index("priorities:\n") + len("priorities:\n")
    path.write_text(text[:at] + BATCH_CLASS + text[at:])
    return path


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _chat_line(i: int, model: str = "small") -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": f"line {i}"}]}}


def _sdk(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float) -> Any:
    done = eventually(lambda: (b := client.batches.retrieve(batch_id)).status in
                      ("completed", "failed", "expired", "cancelled") and b, timeout=timeout)
    assert done, client.batches.retrieve(batch_id)
    return done


def batch_results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def batch_gateway(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-batch")
    policy = _batch_policy(engines, tmp / "policies.yaml")
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{tmp / 'gw.db'}", tmp,
                       "sqlite", {"SWITCHYARD_BATCH_LEASE_S": "10"})
    try:
        gw.keys = {"pro": gw.new_key("batch-co", "pro"), "other": gw.new_key("other-co", "pro")}
        yield gw
    finally:
        assert stop(gw.proc)


def test_the_sdk_batch_flow_end_to_end(batch_gateway: Gateway) -> None:
    client = _sdk(batch_gateway, batch_gateway.keys["pro"])
    lines = [_chat_line(i) for i in range(20)] + [_chat_line(20, model="no-such-model")]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "e2e"})
    done = wait_done(client, batch.id, timeout=60)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (21, 20, 1)
    assert done.metadata == {"job": "e2e"} and done.completed_at and done.finalizing_at
    out = batch_results(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(20)]  # input order, once each
    for result in out:
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
        assert result["response"]["request_id"]
    (failed,) = batch_results(client, done.error_file_id)
    assert failed["custom_id"] == "req-20" and failed["response"]["status_code"] == 404
    assert "no-such-model" in json.dumps(failed)
    # Another tenant sees none of it.
    other = _sdk(batch_gateway, batch_gateway.keys["other"])
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def _spend(gw: Gateway, tenant: str) -> float:
    from tests.integration.conftest import http_json

    status, _, report = http_json("GET", f"{gw.base_url}/admin/api/usage?tenant={tenant}")
    assert status == 200, report
    return float(report["totals"]["spend"])


def test_batch_lines_are_charged_at_the_batch_price(batch_gateway: Gateway, tmp_path: Path) -> None:
    """The test policy prices small at 0.1 / 0.2 per Mtok and declares no batch price: half that."""
    gw = batch_gateway
    tenant_key = gw.new_key("price-co", "pro")
    client = _sdk(gw, tenant_key)
    uploaded = client.files.create(file=("p.jsonl", io.BytesIO(_jsonl([_chat_line(i) for i in range(5)]))),
                                   purpose="batch")
    done = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id, timeout=60)
    usage = [r["response"]["body"]["usage"] for r in batch_results(client, done.output_file_id)]
    prompt, completion = sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)
    expected = (prompt * 0.05 + completion * 0.1) / 1e6
    assert eventually(lambda: abs(_spend(gw, "price-co") - expected) < 1e-12, timeout=10), (_spend(gw, "price-co"),
                                                                                           expected)


CANCELLED_LINES = 2000  # (the worker fills every pool's slots: 400 lines had all run before the cancel landed)


def test_cancel_stops_dispatching_and_finalises_what_ran(batch_gateway: Gateway) -> None:
    client = _sdk(batch_gateway, batch_gateway.keys["pro"])
    lines = [_chat_line(i) for i in range(CANCELLED_LINES)]
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert eventually(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, timeout=60)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_done(client, batch.id, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at, done
    ran = done.request_counts.completed
    assert 10 <= ran < CANCELLED_LINES and done.request_counts.failed == 0, done.request_counts
    out, errors = batch_results(client, done.output_file_id), batch_results(client, done.error_file_id)
    assert len(out) == ran and all(r["response"]["status_code"] == 200 for r in out)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(r["custom_id"] for r in out + errors) == sorted(f"req-{i}" for i in range(CANCELLED_LINES))  # once
    after = client.batches.retrieve(batch.id).request_counts.completed
    assert after == ran  # nothing ran after it was cancelled


# --- crash safety --------------------------------------------------------------------------------

LINES = 2000


def _worker(gw: Gateway, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([SWITCHYARD, "worker"], env={**gw.env, **env}, start_new_session=True)


@pytest.mark.alone  # thousands of lines through killed and restarted workers: other tests beside it starve it
@pytest.mark.timeout(300)
def test_workers_killed_mid_batch_lose_and_duplicate_nothing(engines: Engines, tmp_path: Path,
                                                              pg_database: Callable[[], str]) -> None:
    policy = _batch_policy(engines, tmp_path / "policies.yaml")
    # The gateway only takes uploads; dedicated workers (two at once: SKIP LOCKED) run the lines.
    worker_env = {"SWITCHYARD_BATCH_LEASE_S": "3", "SWITCHYARD_BATCH_CONCURRENCY": "16"}
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), pg_database(), tmp_path, "postgresql",
                       {"SWITCHYARD_BATCH_WORKER": "false"})
    workers: list[subprocess.Popen[bytes]] = []
    try:
        client = _sdk(gw, gw.new_key("crash-co", "pro"))
        uploaded = client.files.create(file=("big.jsonl", io.BytesIO(_jsonl([_chat_line(i) for i in range(LINES)]))),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        kills = 0
        for progress in (0.15, 0.45, 0.75):  # kill -9 at three points of the run, restart each time
            workers += [_worker(gw, worker_env), _worker(gw, worker_env)]
            reached = eventually(lambda p=progress: client.batches.retrieve(batch.id).request_counts.completed
                                 >= p * LINES, timeout=120)
            assert reached, client.batches.retrieve(batch.id)
            victim = workers.pop(0)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            kills += 1
        done = wait_done(client, batch.id, timeout=240)
        assert kills == 3 and done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0), done.request_counts
        out = batch_results(client, done.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert len(ids) == LINES and len(set(ids)) == LINES, "every line exactly once"
        assert ids == [f"req-{i}" for i in range(LINES)]
        assert all(r["response"]["status_code"] == 200 for r in out)
        assert batch_results(client, done.error_file_id) == []
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(timeout=20)
            except subprocess.TimeoutExpired:
                w.kill()
        assert stop(gw.proc)


# --- limits ----------------------------------------------------------------------------------------

PACED_LINES = 72
PACED_RPM = 60  # a bucket of 60 requests that refills one a second: the last 12 lines wait for it
PACED_CONCURRENCY = 8


def test_a_batch_waits_for_its_tenants_rate_limit_instead_of_failing(engines: Engines, tmp_path: Path) -> None:
    """A batch larger than its tenant's requests-per-minute limit is paced to it: every line succeeds although
    a line may be tried only twice (a wait for the budget is not a try), and the request log holds a few
    429s, not one per line per try. A line larger than its tenant's limit fails at once, without retries."""
    policy = _batch_policy(engines, tmp_path / "policies.yaml")
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{tmp_path / 'gw.db'}",
                       tmp_path, "sqlite", {"SWITCHYARD_BATCH_MAX_ATTEMPTS": "2", "SWITCHYARD_KEY_CACHE_TTL_S": "0",
                                            "SWITCHYARD_BATCH_CONCURRENCY": str(PACED_CONCURRENCY)})
    try:
        client = _sdk(gw, gw.new_key("paced-co", "pro"))
        gw.cli("tenants", "set-limits", "paced-co", json.dumps({"requests_per_minute": PACED_RPM}))
        tiny = _sdk(gw, gw.new_key("tiny-co", "pro"))
        gw.cli("tenants", "set-limits", "tiny-co", json.dumps({"tokens_per_minute": 5}))
        jobs = []
        for sdk, lines in ((client, PACED_LINES), (tiny, 3)):
            uploaded = sdk.files.create(file=("l.jsonl", io.BytesIO(_jsonl([_chat_line(i) for i in range(lines)]))),
                                        purpose="batch")
            jobs.append(sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h"))
        done = wait_done(client, jobs[0].id, timeout=120)
        counts = done.request_counts
        assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", PACED_LINES,
                                                                                 PACED_LINES, 0), done
        assert [r["custom_id"] for r in batch_results(client, done.output_file_id)] == [
            f"req-{i}" for i in range(PACED_LINES)]
        status, _, log = http_json("GET", f"{gw.base_url}/admin/api/requests?tenant=paced-co&status=429&limit=500")
        assert status == 200, log
        refused = len(log["requests"])
        # The lines in flight when the bucket ran dry, then about one per refill: not one per line per try.
        assert 0 < refused <= PACED_CONCURRENCY + 2 * (PACED_LINES - PACED_RPM), refused

        small = wait_done(tiny, jobs[1].id, timeout=60)
        assert (small.status, small.request_counts.failed) == ("completed", 3), small
        errors = batch_results(tiny, small.error_file_id)
        assert {e["error"]["code"] for e in errors} == {"request_too_large"}, errors
        status, _, log = http_json("GET", f"{gw.base_url}/admin/api/requests?tenant=tiny-co&status=429&limit=500")
        assert len(log["requests"]) == 3, log  # one try each: no wait makes such a line fit
    finally:
        assert stop(gw.proc)


# --- a slow model does not hold the worker ---------------------------------------------------------

SLOW_LINES, QUICK_LINES, HOL_CONCURRENCY = 6, 8, 4


def test_lines_for_a_slow_model_do_not_hold_the_worker_from_a_free_one(engines: Engines, tmp_path: Path) -> None:
    """A job whose first lines go to a slow pool of one sequence slot (``hang-us`` slowed a thousandfold) and
    the rest to ``small``: the slow pool's batch lane keeps one line waiting, the others go back to the job's
    queue without spending a try, and the worker's room goes to the small lines, which all finish while the
    slow ones are still running. (It used to fill its room with lines waiting for the slow pool.)"""
    policy = tmp_path / "policies.yaml"
    text_ = engines.policy_file.read_text()
    pool = "  - {name: hang-us, region: us-east, served_model: sim-hang, "
    assert pool in text_ and "\ntiers:\n" in text_
    # The batch class last (a header may only lower a request's class), the slow pool with one slot.
    policy.write_text(text_.replace(pool, pool + "max_num_seqs: 1, ").replace("\ntiers:\n", "\n" + BATCH_CLASS
                                                                                  + "tiers:\n"))
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{tmp_path / 'gw.db'}",
                       tmp_path, "sqlite", {"SWITCHYARD_BATCH_CONCURRENCY": str(HOL_CONCURRENCY),
                                            "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "120"})
    status, _, body = http_json("POST", f"{engines.url('hang-us')}/sim/faults", {"mode": "slow", "slow_factor": 1000})
    assert status == 200, body
    try:
        client = _sdk(gw, gw.new_key("hol-co", "pro"))
        slow = [{**_chat_line(i, model="hangs"), "body": {**_chat_line(i, model="hangs")["body"], "max_tokens": 60}}
                for i in range(SLOW_LINES)]
        quick = [_chat_line(SLOW_LINES + i) for i in range(QUICK_LINES)]
        uploaded = client.files.create(file=("h.jsonl", io.BytesIO(_jsonl(slow + quick))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        progress = eventually(lambda: (b := client.batches.retrieve(batch.id)).request_counts is not None
                              and b.request_counts.completed >= QUICK_LINES and b, timeout=30)
        assert progress, client.batches.retrieve(batch.id)
        assert progress.request_counts.failed == 0
        with urllib.request.urlopen(f"{gw.base_url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        sent_back = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("switchyard_shed_total{") and 'reason="lane_full"' in line]
        assert sent_back and sent_back[0] >= 1, [m for m in metrics.splitlines() if m.startswith("switchyard_shed")]
        client.batches.cancel(batch.id)
    finally:
        http_json("POST", f"{engines.url('hang-us')}/sim/faults", {"mode": "none"})
        assert stop(gw.proc)


# --- revocation ----------------------------------------------------------------------------------

IN_FLIGHT = 4
REVOKED_LINES = 40


def _hang(engines: Engines, mode: str) -> None:
    status, _, body = http_json("POST", f"{engines.url('hang-us')}/sim/faults", {"mode": mode})
    assert status == 200, body


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_revoked_keys_lines_stop_at_once(engines: Engines, tmp_path: Path, pg_database: Callable[[], str],
                                           backend: str) -> None:
    """The job's first lines hang in the engine (``hang-us``), the key is revoked (the store call that
    announces it), then the engine is let go: the lines that were in flight finish, and not one more line
    is dispatched (the worker's identity cache follows key changes; it used to trust itself for 5 s).
    SQLite: the gateway's own worker (the marker); PostgreSQL: a dedicated ``switchyard worker`` (NOTIFY)."""
    policy = _batch_policy(engines, tmp_path / "policies.yaml")
    url = f"sqlite:///{tmp_path / 'gw.db'}" if backend == "sqlite" else pg_database()
    env = {"SWITCHYARD_BATCH_CONCURRENCY": str(IN_FLIGHT), "SWITCHYARD_BATCH_LEASE_S": "30",
           "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "60", "SWITCHYARD_KEY_CACHE_TTL_S": "60"}
    standalone = backend == "postgresql"
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), url, tmp_path, backend,
                       {**env, "SWITCHYARD_BATCH_WORKER": "false"} if standalone else env)
    worker = _worker(gw, env) if standalone else None
    engine = db.create_db_engine(url)
    _hang(engines, "hang")
    try:
        client = _sdk(gw, gw.new_key("revoked-co", "pro"))
        with engine.connect() as conn:
            (key_id,) = conn.execute(text("SELECT id FROM api_key")).scalars().all()
        reader = _sdk(gw, gw.new_key("revoked-co", "pro"))  # the tenant's other key reads the results
        lines = [_chat_line(i, model="hangs") for i in range(REVOKED_LINES)]
        uploaded = client.files.create(file=("r.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")

        def in_flight() -> int:
            if not standalone:  # held in the engine, as the gateway counts them
                return int(endpoints(gw)[engines.url("hang-us")]["in_flight"])  # type: ignore[call-overload]
            with engine.connect() as conn:  # claimed by the worker
                return int(conn.execute(text("SELECT count(*) FROM batch_request WHERE state = 'running'"))
                           .scalar_one())

        assert eventually(lambda: in_flight() == IN_FLIGHT, timeout=30), in_flight()
        _, propagation = changing_keys(engine, lambda s: revoke_key(s, int(key_id)))
        assert propagation.complete, propagation.describe()
        _hang(engines, "none")  # the lines in flight answer; every later one must find the key revoked
        done = wait_done(reader, batch.id, timeout=60)
        out, errors = batch_results(reader, done.output_file_id), batch_results(reader, done.error_file_id)
        # Only what was in flight when the revocation returned ran (a dedicated worker's claimed lines may
        # not all have reached the engine yet); everything after it was refused, none dispatched.
        assert len(out) <= IN_FLIGHT and (standalone or len(out) == IN_FLIGHT), (len(out), done.request_counts)
        assert all(r["response"]["status_code"] == 200 for r in out)
        assert len(errors) == REVOKED_LINES - len(out), done.request_counts
        assert {(e["response"]["status_code"], e["error"]["code"]) for e in errors} == {(401, "invalid_api_key")}, \
            errors[:3]
        assert sorted(r["custom_id"] for r in out + errors) == sorted(line["custom_id"] for line in lines)
    finally:
        _hang(engines, "none")
        engine.dispose()
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
        assert stop(gw.proc)
