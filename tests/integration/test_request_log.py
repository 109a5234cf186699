"""The request log: the writer and queries on SQLite and PostgreSQL, and two real gateways on one
database whose console shows each other's requests."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlmodel import Session

from switchyard.gateway.activity import Activity, RequestRecord
from switchyard.store import db, request_log
from switchyard.store.request_log import RequestLogWriter
from tests.integration.conftest import Engines, Gateway, client, eventually, metric_sum, start_gateway, stop


def finished(activity: Activity, rid: str, status: int, *, tenant: str = "acme", model: str = "small",
             at: float | None = None) -> RequestRecord:
    record = activity.begin(rid, "chat", now=at)
    record.tenant, record.tenant_id = tenant, 7 if tenant == "acme" else 8
    record.model = record.served_model = model
    record.pool, record.trace = "small-us", ["model: small (asked)", "route: pool=small-us"]
    record.moved_on = ["http://127.0.0.1:1 connect_error"] if status >= 500 else []
    activity.finish(record, status)
    return record


def test_entries_are_written_in_batches_and_found_by_the_console_filters(engine: Any) -> None:
    writer = RequestLogWriter(engine)
    activity = Activity()
    activity.sink = writer.offer
    finished(activity, "r-ok", 200)
    finished(activity, "r-limited", 429, tenant="other")
    bad = finished(activity, "r-bad", 502, model="large")
    bad.prompt_tokens = 12  # set after it finished (a stream's usage is counted just after): still written
    assert writer.pending == 3
    assert writer.flush() == 3 and writer.pending == 0 and writer.flush() == 0
    with Session(engine) as s:
        assert [r["request_id"] for r in request_log.search(s)] == ["r-bad", "r-limited", "r-ok"]
        assert [r["request_id"] for r in request_log.search(s, tenant="other")] == ["r-limited"]
        assert [r["request_id"] for r in request_log.search(s, tenant="7")] == ["r-bad", "r-ok"]
        assert [r["request_id"] for r in request_log.search(s, model="large")] == ["r-bad"]
        assert [r["request_id"] for r in request_log.search(s, status_class=5)] == ["r-bad"]
        assert [r["request_id"] for r in request_log.search(s, statuses=[429])] == ["r-limited"]
        assert [r["request_id"] for r in request_log.search(s, outcome="ok")] == ["r-ok"]
        assert len(request_log.search(s, limit=2)) == 2
        row = request_log.find(s, "r-bad")
        assert row is not None and request_log.find(s, "nope") is None
    assert row["status"] == 502 and row["outcome"] == "error" and row["prompt_tokens"] == 12
    assert row["trace"] == ["model: small (asked)", "route: pool=small-us"]
    assert row["moved_on"] == ["http://127.0.0.1:1 connect_error"]
    assert re.fullmatch(r".+:\d+", row["replica"]) and row["time"].endswith("Z")


def test_sampling_keeps_every_failure_and_retention_deletes_old_rows(engine: Any) -> None:
    writer = RequestLogWriter(engine, sample_rate=0.0, retention_days=1)
    activity = Activity()
    activity.sink = writer.offer
    old = time.time() - 3 * 86400
    for i in range(5):
        finished(activity, f"ok-{i}", 200)
    finished(activity, "shed", 503)
    finished(activity, "old-fail", 500, at=old)
    assert writer.flush() == 2  # no success at rate 0; both failures
    assert writer.prune(datetime.now(UTC)) == 1
    with Session(engine) as s:
        assert [r["request_id"] for r in request_log.search(s)] == ["shed"]
    half = RequestLogWriter(engine, sample_rate=0.5, seed=1)
    kept = sum(half.offer(finished(Activity(), f"h{i}", 200)) for i in range(400))
    assert 150 < kept < 250


def test_a_failed_write_keeps_the_entries_for_the_next_one(engine: Any) -> None:
    writer = RequestLogWriter(engine)
    activity = Activity()
    activity.sink = writer.offer
    finished(activity, "kept", 200)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE request_log RENAME TO request_log_away"))
    with pytest.raises(OperationalError if engine.dialect.name == "sqlite" else ProgrammingError):
        writer.flush()
    assert writer.pending == 1
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE request_log_away RENAME TO request_log"))
    assert writer.flush() == 1
    with Session(engine) as s:
        assert request_log.find(s, "kept") is not None


class _Flaky:
    """A record whose first write fails (as a database that went away between two chunks would): its first read
    raises, every later one is the record's."""

    def __init__(self, record: RequestRecord) -> None:
        self.record, self.outcome, self.failed = record, record.outcome, False

    def __getattr__(self, name: str) -> Any:
        if not self.failed:
            self.failed = True
            raise OperationalError("INSERT", {}, Exception("the database went away"))
        return getattr(self.record, name)


def test_a_row_holds_what_the_record_says(engine: Any) -> None:
    """Every field of a record's ``as_dict()`` comes back from the log as it was (the time to the millisecond), a
    value longer than its column cut to it, and the detail (trace, moves, resumes, hedges, shadow) whole."""
    writer = RequestLogWriter(engine)
    activity = Activity()
    activity.sink = writer.offer
    record = activity.begin("r-full", "chat", now=1_767_225_600.123_987)
    record.tenant, record.tenant_id, record.key_id, record.tier = "acme", 7, 3, "pro"
    record.model, record.resolved_model, record.served_model = "auto", "x" * 300, "small"
    record.pool, record.region, record.endpoint = "small-us", "us-east", "http://127.0.0.1:9/v1"
    record.stream, record.priority, record.queue_ms, record.attempts = True, "standard", 1.5, 2
    record.moved_on, record.resumes, record.hedges = ["http://127.0.0.1:8 connect_error"], 1, 1
    record.ttft_s, record.prompt_tokens, record.completion_tokens, record.cached_tokens = 0.01234, 12, 7, 4
    record.max_tokens, record.digest, record.deterministic = 64, "ab" * 8, True
    record.cache, record.cache_rule, record.policy_version, record.canary = "miss", "exact", 5, "canary"
    record.shadow = {"model": ["small", "large"]}
    record.trace = ["model: auto → small", "route: pool=small-us"]
    activity.finish(record, 200)
    record.duration_s = 0.2468  # (set by finish; a stream's ends later)
    assert writer.flush() == 1
    with Session(engine) as s:
        row = request_log.find(s, "r-full")
    assert row is not None
    expected = record.as_dict() | {"resolved_model": "x" * 256}
    del expected["batch"]  # (a batch line's record is not a column: batch lines have the batch tables)
    assert expected["time"] == "2026-01-01T00:00:00.123Z" and expected["ttft_ms"] == 12.3
    assert expected["duration_ms"] == 246.8
    assert {name: row[name] for name in expected} == expected


def test_the_periodic_flush_writes_in_paced_chunks_and_keeps_what_it_did_not_write(engine: Any) -> None:
    writer = RequestLogWriter(engine)
    one = request_log.WRITE_ROWS
    records = [finished(Activity(), f"p-{i:03d}", 200) for i in range(2 * one + 8)]
    for record in records:
        writer.offer(record)
    flaky = _Flaky(records[one + request_log.FLUSH_CHUNK + 3])
    writer._buffer[one + request_log.FLUSH_CHUNK + 3] = flaky
    with pytest.raises(OperationalError):
        writer.flush(pause_s=0.001)
    # The first transaction is in; its successor (with the record that failed) and the rest wait for the next flush.
    with Session(engine) as s:
        written = {r["request_id"] for r in request_log.search(s, limit=1000) if r["request_id"].startswith("p-")}
    assert written == {f"p-{i:03d}" for i in range(one)}
    assert writer.pending == len(records) - one
    started = time.monotonic()
    assert writer.flush(pause_s=0.001) == len(records) - one
    assert time.monotonic() - started >= 0.001  # it paused between its chunks
    with Session(engine) as s:
        written = {r["request_id"] for r in request_log.search(s, limit=1000) if r["request_id"].startswith("p-")}
    assert written == {r.request_id for r in records}


def test_a_full_buffer_drops_its_oldest_entries_and_counts_them(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_log, "BUFFER", 5)
    writer = RequestLogWriter(engine)
    activity = Activity()
    for i in range(8):
        writer.offer(finished(activity, f"d-{i}", 200))
    assert (writer.pending, writer.dropped) == (5, 3)
    assert writer.flush() == 5
    with Session(engine) as s:
        kept = s.execute(text("SELECT request_id FROM request_log WHERE request_id LIKE 'd-%'")).scalars().all()
    assert sorted(kept) == [f"d-{i}" for i in range(3, 8)]


@pytest.mark.parametrize(("waiting", "chunk"), [(request_log.BEHIND_ROWS, request_log.FLUSH_CHUNK),
                                              (request_log.BEHIND_ROWS + 1, request_log.BEHIND_CHUNK)])
def test_a_flush_that_fell_behind_pauses_less_often(engine: Any, monkeypatch: pytest.MonkeyPatch, waiting: int,
                                                    chunk: int) -> None:
    """The periodic flush pauses after every FLUSH_CHUNK rows it makes ready, unless more than BEHIND_ROWS wait: then
    after every BEHIND_CHUNK, so that a gateway serving more than the paced chunks write keeps every row."""
    writer = RequestLogWriter(engine)
    activity = Activity()
    for i in range(waiting):
        writer.offer(finished(activity, f"b-{i:05d}", 200))
    pauses: list[float] = []
    monkeypatch.setattr(request_log.time, "sleep", pauses.append)
    assert writer.flush(pause_s=0.002) == waiting
    assert len(pauses) == -(-waiting // chunk) - 1  # (none before the first chunk)
    assert writer.pending == 0 and writer.dropped == 0
    with Session(engine) as s:
        kept = s.execute(text("SELECT count(*) FROM request_log WHERE request_id LIKE 'b-%'")).scalar_one()
    assert kept == waiting


@pytest.fixture(scope="module")
def replicas(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
             pg_database: Callable[[], str]) -> Iterator[tuple[Gateway, Gateway]]:
    url = pg_database()
    started: list[Gateway] = []
    try:
        for name in ("a", "b"):
            data_dir = tmp_path_factory.mktemp(f"gw-log-{name}")
            started.append(start_gateway(engines, url, data_dir, "postgresql",
                                         extra_env={"SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.2",
                                                    "SWITCHYARD_CONSOLE_SECRET": "one-secret-for-both"}))
        started[0].keys = {"pro": started[0].new_key("log-co", "pro")}
        started[1].keys = started[0].keys
        yield started[0], started[1]
    finally:
        for gw in started:
            assert stop(gw.proc)


def test_the_console_shows_another_replicas_requests_from_the_log(replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    raw = client(b, "pro").chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "log me, secret-walrus-9"}], max_tokens=3)
    rid = raw.headers["x-request-id"]
    with pytest.raises(openai.NotFoundError) as refused:  # what a replay of the log needs, even of a refusal
        client(b, "pro").chat.completions.create(model="no-such-model", max_tokens=7,
                                                 messages=[{"role": "user", "content": "who am I?"}])
    refused_id = refused.value.response.headers["x-request-id"]
    console = a.console("viewer")
    live = console.get("/admin/requests")
    assert live.status_code == 200 and rid not in live.text  # a's memory knows nothing of b's request

    def listed() -> str | None:
        page = console.get("/admin/requests", params={"source": "log", "tenant": "log-co"})
        return page.text if page.status_code == 200 and rid in page.text else None

    page = eventually(listed)
    assert page, "b's request never showed in a's console from the request log"
    assert "request log" in page
    detail = console.get(f"/admin/requests/{rid}")  # not in a's memory: from the log, with its trace
    assert detail.status_code == 200 and "small" in detail.text and "route:" in detail.text
    assert "secret-walrus-9" not in page + detail.text
    assert console.get("/admin/requests", params={"source": "nowhere"}).status_code == 400
    assert console.get("/admin/requests", params={"source": "log", "status": "bogus"}).status_code == 400
    # The stored row names the replica that served it.
    with Session(db.create_db_engine(a.env["SWITCHYARD_DATABASE_URL"])) as s:
        row = request_log.find(s, rid)
    assert row is not None and row["served_model"] == "small" and row["completion_tokens"] == 3
    assert row["max_tokens"] == 3 and row["prompt_tokens"] > 0
    assert re.fullmatch(r"[0-9a-f]{16}", row["digest"]) and row["deterministic"] is False
    with Session(db.create_db_engine(a.env["SWITCHYARD_DATABASE_URL"])) as s:
        gone = eventually(lambda: request_log.find(s, refused_id))
    assert gone is not None and (gone["status"], gone["tier"], gone["max_tokens"]) == (404, "pro", 7)
    assert gone["prompt_tokens"] > 0 and gone["completion_tokens"] is None
    assert gone["digest"] not in (None, row["digest"])
    old = datetime.now(UTC) - timedelta(minutes=5)
    assert datetime.fromisoformat(row["time"]) > old
    # The writer's state is in each replica's metrics: nothing waits once written, nothing was dropped.
    for gw in replicas:
        assert eventually(lambda gw=gw: metric_sum(gw.base_url, "switchyard_request_log_pending") == 0)
        assert metric_sum(gw.base_url, "switchyard_request_log_dropped") == 0
        with urllib.request.urlopen(gw.base_url + "/metrics", timeout=5) as scraped:  # (metric_sum reads 0 if absent)
            families = {f.name for f in text_string_to_metric_families(scraped.read().decode())}
        assert {"switchyard_request_log_pending", "switchyard_request_log_dropped"} <= families
